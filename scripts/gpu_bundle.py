"""The wheels the GPU check (scripts/gpu_check.py) needs beyond what the GPU host has, for a host without a registry.

The GPU host this project is lent (docs/gpu.md) has Python 3.12, torch 2.11 and transformers 5.17 with their
dependencies (``scripts/gpu_device_stack.json``) and no network. This script, run where PyPI is reachable,
downloads what the check imports on top of that into ``.gpu_bundle/cp312/`` (one megatron-core wheel per version
checked), proves offline that the folder installs for Python 3.12 together with the device's stack, and keeps it
under the 64 MiB the device tool carries. The carried stack shadows three of the device's packages through
``PYTHONPATH``: transformers 4.57 (the checkpoint manager's HF verification does not run on transformers 5 yet,
docs/models.md) with the tokenizers and huggingface_hub releases it requires.

    python scripts/gpu_bundle.py                      # .gpu_bundle/cp312 (the device) and one for this interpreter
    python scripts/gpu_bundle.py --python 3.12        # only the device's
    python scripts/gpu_bundle.py --resolve-device-stack   # rewrite gpu_device_stack.json from PyPI first
    python scripts/gpu_bundle.py --device-site DIR    # DIR: links to this interpreter's copies of the device's packages

For the interpreter running it (Python 3.11 here) "the device's stack" is what that interpreter has installed of
the device's distributions, so scripts/gpu_check.sh --device cpu can run the check against the same package set.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DEVICE_STACK_FILE = REPO / "scripts" / "gpu_device_stack.json"
DEFAULT_DEST = REPO / ".gpu_bundle"
CARRY_LIMIT_MIB = 64  # what the device tool carries at most
MEGATRON_CORE_VERSIONS = ("0.16.1", "0.18.2")  # the pinned release, and the newest (cp312 wheels only)
# Carried beside megatron-core. transformers, tokenizers and huggingface_hub shadow the device's own releases.
BUNDLE_REQUIREMENTS = (
    "mbridge==0.15.1",
    "transformers==4.57.6",
    "tokenizers>=0.22,<=0.23.0",
    "huggingface-hub>=0.34,<1.0",
    "einops",
    "psutil",
    "zlib-ng==1.1.0",  # the manifest's CRC-32, as requirements.txt installs it for users (the check would fall back to zlib)
)
DEVICE_STACK_REQUIREMENTS = ("torch==2.11.0", "transformers==5.17.0")  # what the GPU host has preinstalled


def _pip(*args: str, offline: bool = False) -> subprocess.CompletedProcess:
    """``python -m pip``; offline, with no configuration file, index or find-links of this host."""
    env = dict(os.environ)
    if offline:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    command = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"gpu_bundle: `pip {' '.join(args)}` failed:\n{result.stderr.strip()[-3000:]}")
    return result


def _dry_run(python: str, requirements: list[str], links: list[Path], constraints: Path, offline: bool) -> list[dict]:
    """What pip would install into an empty ``--target`` for ``python``: the report's install list."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        args += ["--python-version", python, "--only-binary=:all:", "--target", str(Path(scratch) / "target")]
        args += ["-c", str(constraints)] + [f"--find-links={link}" for link in links]
        _pip(*args, *(["--no-index"] if offline else []), *requirements, offline=offline)
        return json.loads(report.read_text())["install"]


def resolve_device_stack() -> dict:
    """The distributions (name -> version) pip installs for the device's two pins on Python 3.12, from PyPI."""
    empty = Path(tempfile.mkdtemp())
    (empty / "constraints.txt").write_text("")
    items = _dry_run("3.12", list(DEVICE_STACK_REQUIREMENTS), [], empty / "constraints.txt", offline=False)
    return dict(sorted((canonicalize_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in items))


def provided_stack(python: str) -> dict[str, str]:
    """The device's distributions minus what the bundle carries: the device's versions for Python 3.12; for this
    interpreter's own version, the versions it has installed of those names (the CPU run of the check)."""
    stack = json.loads(DEVICE_STACK_FILE.read_text())["distributions"]
    carried = {canonicalize_name(Requirement(r).name) for r in BUNDLE_REQUIREMENTS}
    if python == _this_python():
        installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
        stack = {name: installed[name] for name in stack if name in installed}
    return {name: version for name, version in sorted(stack.items()) if name not in carried}


def write_stand_ins(stack: dict[str, str], folder: Path) -> Path:
    """A metadata-only wheel per provided distribution (pip resolves against them; nothing installs them) and a
    constraints file pinning their versions; returns the constraints file."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in stack.items():
        stem = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            wheel.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            wheel.writestr(f"{stem}.dist-info/RECORD", "")
    constraints = folder / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in stack.items()))
    return constraints


def _this_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _megatron_wheel_exists(python: str, version: str) -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        args = ["download", "--quiet", "--no-deps", "--python-version", python, "--only-binary=:all:", "-d", scratch]
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
        env.pop("PIP_FIND_LINKS", None)
        command = [sys.executable, "-m", "pip", *args, f"megatron-core=={version}"]
        return subprocess.run(command, env=env, capture_output=True).returncode == 0


def build(python: str, dest: Path) -> dict:
    """Download, check offline, measure; returns the folder's summary (also written as ``bundle.json``)."""
    folder = dest / f"cp{python.replace('.', '')}"
    folder.mkdir(parents=True, exist_ok=True)
    stack = provided_stack(python)
    versions = [v for v in MEGATRON_CORE_VERSIONS if _megatron_wheel_exists(python, v)]
    skipped = [v for v in MEGATRON_CORE_VERSIONS if v not in versions]
    with tempfile.TemporaryDirectory() as scratch:
        constraints = write_stand_ins(stack, Path(scratch) / "stand_ins")
        links = [Path(scratch) / "stand_ins"]
        needed: dict[str, str] = {}
        for version in versions:
            for item in _dry_run(python, [f"megatron-core=={version}", *BUNDLE_REQUIREMENTS], links, constraints, offline=False):
                name = canonicalize_name(item["metadata"]["name"])
                if name not in stack:
                    needed[f"{name}=={item['metadata']['version']}"] = name
        args = ["download", "--quiet", "--no-deps", "--python-version", python, "--only-binary=:all:", "-d", str(folder)]
        _pip(*args, *sorted(r for r, name in needed.items() if name != "megatron-core"))
        for version in versions:  # one call each: pip refuses two versions of one name in a call
            _pip(*args, f"megatron-core=={version}")
        wanted = {f"{req.split('==')[0].replace('-', '_')}-{req.split('==')[1]}-".lower() for req in needed}
        for stale in folder.glob("*.whl"):  # wheels of an earlier run's pins
            if not any(stale.name.lower().startswith(prefix) for prefix in wanted):
                stale.unlink()
        # Offline, from the folder and the stand-ins only: every requirement and dependency resolves.
        resolved = {}
        for version in versions:
            items = _dry_run(python, [f"megatron-core=={version}", *BUNDLE_REQUIREMENTS], [folder, *links], constraints, offline=True)
            from_bundle = sorted(Path(i["download_info"]["url"]).name for i in items if canonicalize_name(i["metadata"]["name"]) not in stack)
            provided = sorted(canonicalize_name(i["metadata"]["name"]) for i in items if canonicalize_name(i["metadata"]["name"]) in stack)
            resolved[version] = {"from_bundle": from_bundle, "from_the_host": provided}
    wheels = sorted(folder.glob("*.whl"))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    summary = {
        "python": python,
        "megatron_core": versions,
        "megatron_core_without_a_wheel": skipped,
        "wheels": [w.name for w in wheels],
        "mib": round(mib, 2),
        "resolved_offline": resolved,
    }
    (folder / "bundle.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def link_device_site(site: Path) -> list[str]:
    """``site``: symlinks to this interpreter's installed files of the device's distributions, nothing else (the
    CPU run of the check imports from exactly the set of packages the GPU host has, plus the bundle)."""
    site.mkdir(parents=True, exist_ok=True)
    names = set(json.loads(DEVICE_STACK_FILE.read_text())["distributions"])
    linked = []
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in names or not dist.files:
            continue
        base = Path(dist.locate_file(""))
        for top in sorted({f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".."}):
            if top.endswith(".pth") or top == "__pycache__" or not (base / top).exists() or (site / top).exists():
                continue
            (site / top).symlink_to(base / top)
        linked.append(canonicalize_name(dist.metadata["Name"]))
    return sorted(linked)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="Python version(s) to build for (default: 3.12 and this one)")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the bundle's root folder (default .gpu_bundle)")
    parser.add_argument("--resolve-device-stack", action="store_true", help="rewrite gpu_device_stack.json from PyPI")
    parser.add_argument("--device-site", type=Path, help="only link this interpreter's device packages into DIR")
    args = parser.parse_args()
    if args.device_site is not None:
        print(f"gpu_bundle: linked {len(link_device_site(args.device_site))} distributions into {args.device_site}")
        return 0
    if args.resolve_device_stack:
        stack = {"python": "3.12", "requirements": list(DEVICE_STACK_REQUIREMENTS), "distributions": resolve_device_stack()}
        DEVICE_STACK_FILE.write_text(json.dumps(stack, indent=2) + "\n")
    status = 0
    for python in args.python or sorted({"3.12", _this_python()}):
        summary = build(python, args.dest)
        carried = python == "3.12"
        for version, resolved in summary["resolved_offline"].items():
            print(f"gpu_bundle: cp{python.replace('.', '')} megatron-core {version}: resolves offline with "
                  f"{len(resolved['from_bundle'])} wheels of the bundle and {len(resolved['from_the_host'])} of the host")
        for version in summary["megatron_core_without_a_wheel"]:
            print(f"gpu_bundle: cp{python.replace('.', '')}: megatron-core {version} has no wheel for Python {python}; not checked there")
        verdict = f"under the {CARRY_LIMIT_MIB} MiB carry limit" if summary["mib"] < CARRY_LIMIT_MIB else f"OVER the {CARRY_LIMIT_MIB} MiB carry limit"
        print(f"gpu_bundle: {args.dest / ('cp' + python.replace('.', ''))}: {len(summary['wheels'])} wheels, "
              f"{summary['mib']:.1f} MiB" + (f", {verdict}" if carried else ""))
        if carried and summary["mib"] >= CARRY_LIMIT_MIB:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
