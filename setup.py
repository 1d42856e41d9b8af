import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

# The releases declared for the dependencies whose private internals verl reads (verl/utils/internals
# checks each where it is first used), and for exactly pinned ones that need a wider range. requirements.txt
# pins the exact stack the CPU suite runs, which the scripts install; verl.utils.internals.TESTED names the
# releases tested, and docs/cpu.md ("The stack") both.
DECLARED = {
    "torch": ">=2.11,<2.14",
    "megatron-core": ">=0.16.1,<0.19",
    "mbridge": ">=0.15.1,<0.16",
    # 4.57 and 5.10 tested (scripts/test.sh's two legs); 5.6.0 is excluded by verl 0.9.1 and upstream too;
    # <5.20 keeps vLLM's CPU build (5.16.1-5.19) inside the range
    "transformers": ">=4.57,!=5.6.0,<5.20",
    # public API only (its crc32); every release since 1.0 has it, and without it the standard zlib computes the same
    "zlib-ng": ">=1.0",
}


def _requirement(line: str) -> str:
    """A requirements.txt line as install_requires has it: a declared range in place of the exact pin."""
    name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
    return name + DECLARED[name] if name in DECLARED else line


requirements = [
    _requirement(line.split("#")[0].strip())
    for line in (here / "requirements.txt").read_text().splitlines()
    if line.split("#")[0].strip()
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
