"""The GPU check's bundle and the check itself, on this CPU host (docs/gpu.md).

One command builds the wheels for the GPU host (Python 3.12) and for this interpreter from PyPI and proves each
folder resolves offline; the check then runs here as it will there: the bundle installed with pip
``--no-index --no-deps --target``, the interpreter started with ``-S`` beside only its copies of the GPU host's
packages, one rank, gloo instead of NCCL. Every row must pass, read from the JSON the check writes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
CHECKS = ["environment", "offload DO=False", "offload DO=True", "save while offloaded", "hf export", "dist-ckpt load",
          "async save DO=True", "ppo update, host batch"]  # fmt: skip


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("gpu_bundle")
    command = [sys.executable, "scripts/gpu_bundle.py", "--dest", str(dest), "--python", "3.12", "--python", THIS_PYTHON]
    subprocess.run(command, cwd=REPO, check=True, timeout=300)
    return dest


def test_the_device_bundle_resolves_offline_under_the_carry_limit(bundle):
    summary = json.loads((bundle / "cp312" / "bundle.json").read_text())
    assert summary["mib"] < 64, summary["mib"]
    assert summary["megatron_core"] == ["0.16.1", "0.18.2"]
    for version, resolved in summary["resolved_offline"].items():
        assert f"megatron_core-{version}-cp312-cp312" in " ".join(resolved["from_bundle"]), resolved
        assert {"torch", "numpy", "safetensors"} <= set(resolved["from_the_host"]), resolved
    names = " ".join(summary["wheels"])
    assert "transformers-4.57" in names and "mbridge-0.15.1" in names  # the host's transformers 5 is shadowed
    assert "zlib_ng-1.1.0-cp312" in names  # the manifest's CRC-32 as users install it


def test_the_check_passes_on_cpu_from_the_bundle(bundle, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out), "--bundle", str(bundle / f"cp{THIS_PYTHON.replace('.', '')}")]
    completed = subprocess.run(command, cwd=REPO, env=env, timeout=240, capture_output=True, text=True)
    results = json.loads((out / "summary.json").read_text())["results"]
    assert [r["megatron_core"] for r in results] == json.loads((bundle / f"cp{THIS_PYTHON.replace('.', '')}" / "bundle.json").read_text())["megatron_core"]
    for result in results:
        rows = {row["check"]: row for row in result["rows"]}
        assert list(rows) == CHECKS
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
