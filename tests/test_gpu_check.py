"""The GPU check's bundle and the check itself, on this CPU host (docs/gpu.md).

One command builds the wheels for the GPU host (Python 3.12) and for this interpreter from PyPI and proves each
folder resolves offline; the check then runs here as it will there: the bundle installed with pip
``--no-index --no-deps --target``, the interpreter started with ``-S`` beside only its copies of the GPU host's
packages, one rank, gloo instead of NCCL. Every row must pass, read from the JSON the check writes. On the Python
3.12 leg this interpreter's bundle is the device's own, Megatron-Bridge included: the check the device will run.
"""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from scripts.gpu_bundle import canonical, exact_pins, pinned_version, read_requirements, write_stand_ins

REPO = Path(__file__).resolve().parent.parent
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
THIS_TAG = f"cp{THIS_PYTHON.replace('.', '')}"
CHECKS = ["environment", "offload DO=False", "offload DO=True", "save while offloaded", "hf export", "dist-ckpt load",
          "async save DO=True", "ppo update, host batch"]  # fmt: skip
BRIDGE_CHECKS = ["megatron-bridge save", "megatron-bridge hf export"]
LEGS = {"requirements.txt": exact_pins(REPO / "requirements.txt"), "requirements-py312.txt": exact_pins(REPO / "requirements-py312.txt")}
MAIN_PIN, PY312_PIN = LEGS["requirements.txt"]["megatron-core"], LEGS["requirements-py312.txt"]["megatron-core"]
BRIDGE_PIN = LEGS["requirements-py312.txt"]["megatron-bridge"]
STALE = f"transformers-{LEGS['requirements.txt']['transformers']}-py3-none-any.whl"  # a wheel in the wrong folder


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """Both folders built into a destination where an earlier build left a wheel in a folder it no longer goes to
    (the check installs every wheel of a run, so a second transformers there would stop its install)."""
    dest = tmp_path_factory.mktemp("gpu_bundle")
    pythons = list(dict.fromkeys(["3.12", THIS_PYTHON]))
    for python in pythons:
        stale = dest / f"cp{python.replace('.', '')}" / f"megatron-core-{MAIN_PIN}"
        stale.mkdir(parents=True)
        (stale / STALE).write_bytes(b"")
    command = [sys.executable, "scripts/gpu_bundle.py", "--dest", str(dest), *(arg for p in pythons for arg in ("--python", p))]
    subprocess.run(command, cwd=REPO, check=True, timeout=300)
    return dest


def _wheels_of_run(folder: Path, version: str) -> list[str]:
    """What scripts/gpu_check.sh installs for megatron-core ``version``: the top's wheels but the other
    megatron-core ones, and the run's own folder."""
    top = [w.name for w in folder.glob("*.whl") if not w.name.startswith("megatron_core-") or w.name.startswith(f"megatron_core-{version}-")]
    return top + [w.name for w in (folder / f"megatron-core-{version}").glob("*.whl")]


def test_the_device_bundle_resolves_offline_under_the_carry_limit(bundle):
    summary = json.loads((bundle / "cp312" / "bundle.json").read_text())
    assert summary["mib"] + summary["working_tree_mib"] < 64, summary["mib"]
    assert summary["megatron_core"] == [MAIN_PIN, PY312_PIN]  # one run per leg's megatron-core
    for version, resolved in summary["resolved_offline"].items():
        assert f"megatron_core-{version}-cp312-cp312" in " ".join(resolved["from_bundle"]), resolved
        assert {"torch", "numpy", "safetensors"} <= set(resolved["from_the_host"]), resolved
        assert "hydra_core-" in " ".join(resolved["from_bundle"]), resolved  # the engine's configs come from the YAML
        # each run carries what its own leg pins
        pins = LEGS[summary["legs"][version]]
        assert pins["megatron-core"] == version
        for name in ("mbridge", "transformers", "zlib-ng"):
            assert summary["carried"][version][name] == pins[name], (version, name)
    names = " ".join(summary["wheels"])
    assert "zlib_ng-1.1.0-cp312" in names  # the manifest's CRC-32 as users install it
    bridge = f"megatron-core-{PY312_PIN}/megatron_bridge-{BRIDGE_PIN}-"
    assert bridge in names and summary["megatron_bridge"]["with_megatron_core"] == PY312_PIN  # with the 3.12 leg's release
    assert "omegaconf" in " ".join(summary["resolved_offline"][PY312_PIN]["from_bundle"])  # what Megatron-Bridge imports


def test_each_run_installs_one_wheel_of_each_name(bundle):
    """An earlier build's wheel left in a folder it no longer goes to is gone: every run of the check installs one
    wheel per distribution (pip refuses two)."""
    for folder in {bundle / "cp312", bundle / THIS_TAG}:
        for version in json.loads((folder / "bundle.json").read_text())["megatron_core"]:
            names = Counter(canonical(wheel.split("-")[0]) for wheel in _wheels_of_run(folder, version))
            assert names and max(names.values()) == 1, (folder.name, version, names.most_common(3))


def _for_the_device(wheel: str) -> bool:
    """A wheel CPython 3.12 on x86-64 Linux installs (by its file name's tags)."""
    python, abi, platform = wheel.removesuffix(".whl").split("-")[-3:]
    stable = abi == "abi3"  # the stable ABI: built for an older CPython 3, loads on 3.12
    python_ok = any(tag in ("cp312", "py3", "py312") or stable and tag.startswith("cp3") and int(tag[3:]) <= 12 for tag in python.split("."))
    platform_ok = platform == "any" or all(p.startswith("manylinux") and p.endswith("_x86_64") for p in platform.split("."))
    return python_ok and abi in ("cp312", "abi3", "none") and platform_ok


def test_a_fresh_interpreter_with_an_old_pip_and_no_torch_on_another_platform_resolves_the_device_bundle(tmp_path):
    """`python scripts/gpu_bundle.py` on a fresh machine: that ``python`` has no torch and a pip older than 24.2,
    whose resolver checks Requires-Python against the running interpreter, not ``--python-version`` (upstream pip
    #12216), and it reports another platform (64-bit Arm). The device's plan still resolves (pip 26.3 runs from its
    wheel), from the legs' pins, to wheels the GPU host installs (CPython 3.12, manylinux x86-64), and no bundle of
    gigabytes is made for an interpreter that could not run the check."""
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "pip==23.2.1"], check=True, timeout=120)
    dest = tmp_path / "bundle"
    arm = dict(os.environ, _PYTHON_HOST_PLATFORM="linux-aarch64")  # what sysconfig, and so pip's tags, report
    run = subprocess.run([python, "scripts/gpu_bundle.py", "--resolve-only", "--dest", str(dest)], cwd=REPO, env=arm,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in dest.iterdir()) == ["cp312"]  # nothing for the interpreter without torch
    plan = json.loads((dest / "cp312" / "plan.json").read_text())
    assert plan["megatron_core"] == [MAIN_PIN, PY312_PIN]
    for version, leg in plan["legs"].items():
        for name in ("mbridge", "transformers"):
            assert plan["carried"][version][name] == LEGS[leg][name]
    assert plan["megatron_bridge"] == {"requirement": f"megatron-bridge=={BRIDGE_PIN}", "with_megatron_core": PY312_PIN}
    assert not any("torch" in carried or "numpy" in carried for carried in plan["carried"].values())  # the device's own
    files = [wheel for run_files in plan["files"].values() for wheel in run_files]
    assert any(wheel.startswith(f"megatron_core-{PY312_PIN}-") for wheel in files), files
    assert [wheel for wheel in files if not _for_the_device(wheel)] == []


def test_an_index_that_cannot_be_read_is_refused_in_one_line(tmp_path):
    """An unreachable index is not "megatron-core has no wheel": the script stops with one line naming it, and
    writes no plan (it used to write one without any run and exit 0)."""
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/simple/", PIP_RETRIES="0", PIP_TIMEOUT="2")
    run = subprocess.run([sys.executable, "scripts/gpu_bundle.py", "--resolve-only", "--python", "3.12", "--dest", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(f"gpu_bundle: could not ask the package index for megatron-core {MAIN_PIN}"), lines
    assert not list(tmp_path.rglob("plan.json"))


def test_a_requirements_line_it_cannot_read_and_a_missing_pin_are_refused_in_one_line(tmp_path):
    broken = tmp_path / "requirements.txt"
    broken.write_text("torch==2.13.0\n<=2.0  # no name\n")
    with pytest.raises(SystemExit) as unreadable:
        read_requirements(broken)
    assert str(unreadable.value) == "gpu_bundle: requirements.txt: '<=2.0' names no distribution; write `name==version`"
    with pytest.raises(SystemExit) as unpinned:
        pinned_version("3.11", "no-such-distribution")
    assert str(unpinned.value).startswith("gpu_bundle: requirements.txt pins no no-such-distribution; add ")


def test_the_check_passes_on_cpu_from_the_bundle(bundle, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out), "--bundle", str(bundle / THIS_TAG)]
    completed = subprocess.run(command, cwd=REPO, env=env, timeout=240, capture_output=True, text=True)
    results = json.loads((out / "summary.json").read_text())["results"]
    assert [r["megatron_core"] for r in results] == json.loads((bundle / THIS_TAG / "bundle.json").read_text())["megatron_core"]
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
        if with_bridge:  # the bundle's Megatron-Bridge, its own HF save in fix 2's order
            assert environment["megatron-bridge"] == BRIDGE_PIN
            assert Path(environment["megatron_bridge_from"]).name == f"megatron-core-{PY312_PIN}", environment
            assert rows["megatron-bridge save"]["numbers"]["config_on_disk_at_hf_weights"] is True
    assert completed.returncode == 0, completed.stderr[-4000:]


def test_a_carried_megatron_bridge_that_does_not_import_fails_the_check(bundle, tmp_path):
    """Where the bundle carries a Megatron-Bridge wheel for a release, gpu_check.sh asks for its rows: a wheel that
    installs but does not import (here one holding only its metadata) fails the environment row, its own rows
    and the run, instead of the rows silently dropping out. One megatron-core release, to keep it short."""
    folder = tmp_path / "bundle"
    shutil.copytree(bundle / THIS_TAG, folder)
    for other in folder.glob("megatron_core-*.whl"):
        if not other.name.startswith(f"megatron_core-{MAIN_PIN}-"):
            other.unlink()
    write_stand_ins({"megatron-bridge": BRIDGE_PIN}, folder / f"megatron-core-{MAIN_PIN}")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    command = ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out), "--bundle", str(folder)]
    completed = subprocess.run(command, cwd=REPO, env=env, timeout=240, capture_output=True, text=True)
    (result,) = json.loads((out / "summary.json").read_text())["results"]
    rows = {row["check"]: row for row in result["rows"]}
    assert list(rows) == CHECKS + BRIDGE_CHECKS, completed.stderr[-3000:]
    environment = rows["environment"]
    assert not environment["ok"] and environment["numbers"]["megatron-bridge"] == BRIDGE_PIN
    assert environment["numbers"]["megatron_bridge_from"].startswith("not importable"), environment
    assert not any(rows[name]["ok"] for name in BRIDGE_CHECKS)
    assert completed.returncode == 1


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
