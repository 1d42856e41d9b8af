from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
requirements = [
    line.strip()
    for line in (here / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

setup(
    name="verl",
    version="0.1.0",
    description="verl overlay: trustworthy Megatron checkpointing for RL training",
    packages=find_packages(include=["verl", "verl.*"]),
    package_data={"verl": ["trainer/config/*.yaml"]},
    python_requires=">=3.11",  # the only version tested (README)
    install_requires=requirements,
    extras_require={"test": ["pytest>=8", "ruff"]},
)
