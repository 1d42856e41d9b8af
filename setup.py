import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

# The releases declared for the dependencies whose private internals verl reads (verl/utils/internals
# checks each where it is first used), and for exactly pinned ones that need a wider range. Each range's two ends
# are releases a leg of scripts/test.sh runs (tests/test_declared_ranges.py holds them to it): requirements.txt
# (Python 3.11: torch 2.13.0, megatron-core 0.16.1, transformers 5.10.4), its transformers 4.57.6 leg, and
# requirements-py312.txt (Python 3.12: torch 2.14.1, megatron-core 0.18.2, Megatron-Bridge 0.6.2); docs/cpu.md
# ("The stack") dates each end. verl.utils.internals.TESTED names the releases the contract tests passed on.
DECLARED = {
    "torch": ">=2.13.0,<=2.14.1",
    "megatron-core": ">=0.16.1,<=0.18.2",
    "mbridge": "==0.15.1",
    "transformers": ">=4.57.6,!=5.6.0,<=5.10.4",  # 5.6.0 is excluded by verl 0.9.1 and upstream too
}
# Megatron-Bridge, upstream's default bridge: install it with --no-deps (docs/cpu.md says why), as upstream does.
EXTRAS = {
    "megatron-bridge": ["megatron-bridge==0.6.2; python_version >= '3.12'"],  # its wheels need Python 3.12
    "test": ["pytest>=8", "ruff"],
}
PYTHON_REQUIRES = ">=3.11,<3.13"  # 3.11.7 (requirements.txt's legs) and 3.12.1 (requirements-py312.txt's)


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
    python_requires=PYTHON_REQUIRES,
    install_requires=requirements,
    extras_require=EXTRAS,
)
