"""The GPU check's bundle and the check itself, on this CPU host (docs/gpu.md).

One command builds the wheels for the GPU host (Python 3.12) and for this interpreter from PyPI and proves each
folder resolves offline; the check then runs here as it will there: the bundle installed with pip
``--no-index --no-deps --target``, the interpreter started with ``-S`` beside only its copies of the GPU host's
packages, one rank, gloo instead of NCCL. Every row must pass, read from the JSON the check writes. On the Python
3.12 leg this interpreter's bundle is the device's own, Megatron-Bridge included: the check the device will run.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
CHECKS = ["environment", "offload DO=False", "offload DO=True", "save while offloaded", "hf export", "dist-ckpt load",
          "async save DO=True", "ppo update, host batch"]  # fmt: skip
BRIDGE_CHECKS = ["megatron-bridge save", "megatron-bridge hf export"]


def _pin(requirements: str, name: str) -> str:
    return re.search(rf"^{re.escape(name)}==([0-9.]+)", (REPO / requirements).read_text(), re.M).group(1)


MAIN_PIN, PY312_PIN = _pin("requirements.txt", "megatron-core"), _pin("requirements-py312.txt", "megatron-core")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("gpu_bundle")
    pythons = [arg for python in dict.fromkeys(["3.12", THIS_PYTHON]) for arg in ("--python", python)]
    command = [sys.executable, "scripts/gpu_bundle.py", "--dest", str(dest), *pythons]
    subprocess.run(command, cwd=REPO, check=True, timeout=300)
    return dest


def test_the_device_bundle_resolves_offline_under_the_carry_limit(bundle):
    summary = json.loads((bundle / "cp312" / "bundle.json").read_text())
    assert summary["mib"] + summary["working_tree_mib"] < 64, summary["mib"]
    assert summary["megatron_core"] == [MAIN_PIN, PY312_PIN]  # one run per leg's megatron-core
    for version, resolved in summary["resolved_offline"].items():
        assert f"megatron_core-{version}-cp312-cp312" in " ".join(resolved["from_bundle"]), resolved
        assert {"torch", "numpy", "safetensors"} <= set(resolved["from_the_host"]), resolved
    names = " ".join(summary["wheels"])
    assert f"transformers-{_pin('requirements-py312.txt', 'transformers')}-" in names  # the device's 5.17 is shadowed
    assert f"mbridge-{_pin('requirements-py312.txt', 'mbridge')}-" in names
    assert "zlib_ng-1.1.0-cp312" in names  # the manifest's CRC-32 as users install it
    bridge = f"megatron-core-{PY312_PIN}/megatron_bridge-{_pin('requirements-py312.txt', 'megatron-bridge')}-"
    assert bridge in names and summary["megatron_bridge"]["with_megatron_core"] == PY312_PIN  # with the 3.12 leg's release
    assert "omegaconf" in " ".join(summary["resolved_offline"][PY312_PIN]["from_bundle"])  # what Megatron-Bridge imports


def test_a_fresh_interpreter_with_an_old_pip_and_no_torch_resolves_the_device_bundle(tmp_path):
    """`python scripts/gpu_bundle.py` on a fresh machine: that ``python`` has no torch and a pip older than 24.2,
    whose resolver checks Requires-Python against the running interpreter, not ``--python-version`` (upstream pip
    #12216). The device's plan still resolves (a current pip runs from its wheel), from the legs' pins, and no
    bundle of gigabytes is made for an interpreter that could not run the check."""
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "pip==23.2.1"], check=True, timeout=120)
    dest = tmp_path / "bundle"
    run = subprocess.run([python, "scripts/gpu_bundle.py", "--resolve-only", "--dest", str(dest)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in dest.iterdir()) == ["cp312"]  # nothing for the interpreter without torch
    plan = json.loads((dest / "cp312" / "plan.json").read_text())
    assert plan["megatron_core"] == [MAIN_PIN, PY312_PIN]
    for name in ("mbridge", "transformers"):
        assert plan["carried"][PY312_PIN][name] == _pin("requirements-py312.txt", name)
    assert plan["megatron_bridge"] == {"requirement": f"megatron-bridge=={_pin('requirements-py312.txt', 'megatron-bridge')}",
                                       "with_megatron_core": PY312_PIN}  # fmt: skip
    assert not any("torch" in carried or "numpy" in carried for carried in plan["carried"].values())  # the device's own


def test_the_check_passes_on_cpu_from_the_bundle(bundle, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out), "--bundle", str(bundle / f"cp{THIS_PYTHON.replace('.', '')}")]
    completed = subprocess.run(command, cwd=REPO, env=env, timeout=240, capture_output=True, text=True)
    results = json.loads((out / "summary.json").read_text())["results"]
    assert [r["megatron_core"] for r in results] == json.loads((bundle / f"cp{THIS_PYTHON.replace('.', '')}" / "bundle.json").read_text())["megatron_core"]
    for result in results:
        rows = {row["check"]: row for row in result["rows"]}
        with_bridge = THIS_PYTHON == "3.12" and result["megatron_core"] == PY312_PIN  # Megatron-Bridge needs Python 3.12
        assert list(rows) == CHECKS + (BRIDGE_CHECKS if with_bridge else [])
        failed = {name: row for name, row in rows.items() if not row["ok"]}
        assert not failed, (failed, completed.stderr[-4000:])
        environment = rows["environment"]["numbers"]
        assert environment["backend"] == "gloo" and environment["device"] == "cpu"
        assert environment["crc32"] == "zlib_ng.zlib_ng"  # the bundle's zlib-ng hashes the manifest, as on users' hosts
        # imported from the --target install, not from this interpreter's site-packages
        for key in ("megatron_core_from", "transformers_from", "zlib_ng_from"):
            assert Path(environment[key]).name == f"megatron-core-{result['megatron_core']}", environment
        assert rows["save while offloaded"]["numbers"]["config_on_disk_at_hf_weights"] is True
        assert rows["async save DO=True"]["numbers"]["pending"] is True
        assert rows["ppo update, host batch"]["numbers"]["log_probs_device"] == "cpu"
        if with_bridge:  # Megatron-Bridge's own HF save, in fix 2's order
            assert rows["megatron-bridge save"]["numbers"]["config_on_disk_at_hf_weights"] is True
            assert Path(environment["megatron_core_from"]).name == f"megatron-core-{PY312_PIN}"
    assert completed.returncode == 0, completed.stderr[-4000:]


def test_cuda_without_a_gpu_and_a_missing_bundle_are_refused_in_one_line(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    refused = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cuda", "--out", str(tmp_path / "o")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "torch sees no CUDA device" in refused.stderr, refused.stderr
    assert not (tmp_path / "o").exists()
    empty = tmp_path / "empty_bundle"
    empty.mkdir()
    missing = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cuda", "--out", str(tmp_path / "p"), "--bundle", str(empty)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "python scripts/gpu_bundle.py" in missing.stderr, missing.stderr
