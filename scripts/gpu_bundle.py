"""The wheels the GPU check (scripts/gpu_check.py) needs beyond what the GPU host has, for a host without a registry.

The GPU host this project is lent (docs/gpu.md) has Python 3.12, torch 2.11 and transformers 5.17 with their
dependencies (``scripts/gpu_device_stack.json``) and no network. This script, run where PyPI is reachable,
downloads what the check imports on top of that into ``.gpu_bundle/cp312/``, proves offline that the folder
installs for Python 3.12 together with the device's stack, and keeps it and the working tree under the 64 MiB
the device tool carries. What it carries is what the CPU legs pin, read from their requirements files, so the
device runs what they passed: one megatron-core wheel per leg (``requirements.txt``: 0.16.1, the Python 3.11
leg; ``requirements-py312.txt``: 0.18.2), each with its own leg's mbridge, transformers and zlib-ng (transformers
shadowing the device's 5.17 through ``PYTHONPATH``, with the tokenizers release it accepts) and the legs' Hydra
(the check composes the engine's configs from the trainer's YAML), and, for the 3.12 leg's megatron-core only,
Megatron-Bridge (installed without its declared dependencies, as that leg installs it), in
``cp312/megatron-core-<version>/``.

    python scripts/gpu_bundle.py                      # .gpu_bundle/cp312 (the device) and one for this interpreter
    python scripts/gpu_bundle.py --python 3.12        # only the device's
    python scripts/gpu_bundle.py --resolve-only       # only what would be carried (plan.json), no wheel downloaded
    python scripts/gpu_bundle.py --resolve-device-stack   # rewrite gpu_device_stack.json from PyPI first
    python scripts/gpu_bundle.py --device-site DIR    # DIR: links to this interpreter's copies of the device's packages

For the interpreter running it (Python 3.11 here) "the device's stack" is what that interpreter has installed of
the device's distributions, so scripts/gpu_check.sh --device cpu can run the check against the same package set;
an interpreter without torch gets no bundle of its own (it could not run the check). The cross-version
resolution needs pip 24.2 or newer (older pip checks Requires-Python against the running interpreter whatever
``--python-version`` says, upstream pip #12216): with an older one the script runs pip 26.3 from its wheel.
Every pip call for the device's bundle names the GPU host's interpreter and platforms (CPython 3.12, manylinux
x86-64 up to glibc 2.39), so any machine builds the same bundle. An index that cannot be read, a leg's
megatron-core without a cp312 wheel, or a requirements line it cannot read is refused in one line.
Only the standard library is imported, so any Python 3 with pip runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEVICE_STACK_FILE = REPO / "scripts" / "gpu_device_stack.json"
LEG_REQUIREMENTS = {"3.11": REPO / "requirements.txt", "3.12": REPO / "requirements-py312.txt"}
DEFAULT_DEST = REPO / ".gpu_bundle"
CARRY_LIMIT_MIB = 64  # what the device tool carries at most: the working tree and the bundle together
# upstream pip #12216: before 24.2, install's resolver checked Requires-Python against the running interpreter
PIP_HONOURING_PYTHON_VERSION = (24, 2)
PIP_RELEASE = "26.3"  # the pip run from its wheel where the interpreter's predates that (the legs' venvs run it)
# Carried whatever the device has: the device's tokenizers (0.23.3) is outside the legs' transformers' range.
SHADOWED = ("tokenizers",)
ALSO_CARRIED = ("einops", "psutil")  # imported by mbridge / megatron's async writer; tiny
# What every run imports that the device's stack lacks: Hydra composes the engine's configs from the trainer's YAML
# (verl.workers.config.megatron_actor_configs_from_yaml), so the check states no default of its own.
CONFIG_NEEDS = ("hydra-core", "omegaconf")
# Megatron-Bridge's own imports on verl's path that the device's stack lacks (its kept list minus the device's).
MEGATRON_BRIDGE_NEEDS = ("omegaconf",)
# Pure-Python packages PyPI has only as an sdist (omegaconf's parser runtime): built into a wheel here.
BUILT_HERE = ("antlr4-python3-runtime==4.9.*",)
DEVICE_STACK_REQUIREMENTS = ("torch==2.11.0", "transformers==5.17.0")  # what the GPU host has preinstalled
DEVICE_PYTHON = "3.12"
# The GPU host: CPython 3.12 on x86-64 with glibc 2.39, so every manylinux tag up to 2.39 (pip matches each exactly).
DEVICE_PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64",
                    "manylinux2010_x86_64", "manylinux1_x86_64")  # fmt: skip


def canonical(name: str) -> str:
    """A distribution's normalized name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def requirement_name(requirement: str) -> str:
    return canonical(NAME.match(requirement.strip()).group(0))


def read_requirements(path: Path) -> dict[str, str]:
    """name -> requirement line (comments dropped) of a requirements file; a line that names no distribution
    (options such as ``-r`` aside) is refused in one line."""
    requirements = {}
    for line in (line.split("#")[0].strip() for line in path.read_text().splitlines()):
        if not line or line.startswith("-"):
            continue
        name = NAME.match(line)
        if name is None:
            raise SystemExit(f"gpu_bundle: {path.name}: {line!r} names no distribution; write `name==version`")
        requirements[canonical(name.group(0))] = line
    return requirements


def exact_pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's exact pins (``name==version``, extras and comments allowed)."""
    pins = {}
    for name, line in read_requirements(path).items():
        match = re.fullmatch(r"[A-Za-z0-9_.\[\], -]+==([0-9][0-9A-Za-z.+]*)", line)
        if match is not None:
            pins[name] = match.group(1)
    return pins


def leg_requirements(leg: str) -> dict[str, str]:
    """name -> requirement line of the leg that runs Python ``leg`` (a key of ``LEG_REQUIREMENTS``)."""
    return read_requirements(LEG_REQUIREMENTS[leg])


def pinned_version(leg: str, name: str) -> str:
    path = LEG_REQUIREMENTS[leg]
    line = leg_requirements(leg).get(canonical(name))
    if line is None:
        raise SystemExit(f"gpu_bundle: {path.name} pins no {name}; add `{name}==<version>` (the bundle carries the legs' pins)")
    version = exact_pins(path).get(canonical(name))
    if version is None:
        raise SystemExit(f"gpu_bundle: {path.name}: {line!r} is not an exact pin; pin it")
    return version


def carried_requirements(leg: str) -> list[str]:
    """What a run of the check carries beside its megatron-core wheel, pinned as ``leg`` pins it."""
    exact = [f"{name}=={pinned_version(leg, name)}" for name in ("mbridge", "transformers", "zlib-ng")]
    return exact + list(SHADOWED) + list(ALSO_CARRIED)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the check: a leg's megatron-core with what that leg pins beside it (and, where the leg installs
    Megatron-Bridge, that too, with its imports the device lacks)."""

    leg: str
    megatron_core: str
    requirements: tuple[str, ...]
    megatron_bridge: str | None


def leg_run(leg: str) -> Run:
    requirements = leg_requirements(leg)
    version = pinned_version(leg, "megatron-core")
    bridge = f"megatron-bridge=={pinned_version(leg, 'megatron-bridge')}" if "megatron-bridge" in requirements else None
    names = dict.fromkeys(CONFIG_NEEDS + (MEGATRON_BRIDGE_NEEDS if bridge else ()))
    needs = [requirements.get(name, name) for name in names]
    return Run(leg, version, (f"megatron-core=={version}", *carried_requirements(leg), *needs), bridge)


def leg_runs() -> list[Run]:
    """One run per leg's megatron-core, in the legs' order; two legs on one release are one run if they pin the
    same beside it, else refused."""
    runs: dict[str, Run] = {}
    for leg in LEG_REQUIREMENTS:
        run = leg_run(leg)
        seen = runs.setdefault(run.megatron_core, run)
        if (seen.requirements, seen.megatron_bridge) != (run.requirements, run.megatron_bridge):
            raise SystemExit(f"gpu_bundle: {LEG_REQUIREMENTS[seen.leg].name} and {LEG_REQUIREMENTS[leg].name} both pin "
                             f"megatron-core {run.megatron_core} but differ beside it; one run per release: align them")  # fmt: skip
    return list(runs.values())


@functools.cache
def _pip_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="gpu_bundle_pip.")  # removed when the script exits


@functools.cache
def pip_command() -> tuple[str, ...]:
    """``python -m pip``, or, where that pip predates 24.2, pip ``PIP_RELEASE`` run from its wheel (fetched by the
    old one): older pip resolves a cross-version ``install --dry-run`` against this interpreter's version."""
    version = tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version("pip"))[:2])
    if version >= PIP_HONOURING_PYTHON_VERSION:
        return (sys.executable, "-m", "pip")
    folder = Path(_pip_folder().name)
    _run((sys.executable, "-m", "pip"), "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(folder),
         f"pip=={PIP_RELEASE}")
    wheel = next(folder.glob("pip-*.whl"))
    print(f"gpu_bundle: pip {importlib.metadata.version('pip')} checks Requires-Python against Python "
          f"{_this_python()}, not --python-version; using {wheel.name} instead")
    return (sys.executable, str(wheel / "pip"))


def _run(pip: tuple[str, ...], *args: str, offline: bool = False) -> subprocess.CompletedProcess:
    """``pip ARGS``; offline, with no configuration file, index or find-links of this host."""
    env = dict(os.environ)
    if offline:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    result = subprocess.run([*pip, *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"gpu_bundle: `pip {' '.join(args)}` failed:\n{result.stderr.strip()[-3000:]}")
    return result


def _pip(*args: str, offline: bool = False) -> subprocess.CompletedProcess:
    return _run(pip_command(), *args, offline=offline)


def target_tags(python: str) -> list[str]:
    """pip's options for the wheels of ``python``: the GPU host's interpreter and platforms for the device's
    Python whatever machine builds it; this interpreter's own tags (its CPU bundle) otherwise."""
    options = ["--python-version", python, "--only-binary=:all:"]
    if python == DEVICE_PYTHON:
        options += ["--implementation", "cp", "--abi", "cp" + python.replace(".", "")]
        options += [f"--platform={platform}" for platform in DEVICE_PLATFORMS]
    return options


def _dry_run(python: str, requirements: list[str], links: list[Path], constraints: Path, offline: bool) -> list[dict]:
    """What pip would install into an empty ``--target`` for ``python``: the report's install list."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        args += [*target_tags(python), "--target", str(Path(scratch) / "target")]
        args += ["-c", str(constraints)] + [f"--find-links={link}" for link in links]
        _pip(*args, *(["--no-index"] if offline else []), *requirements, offline=offline)
        return json.loads(report.read_text())["install"]


def resolve_device_stack() -> dict:
    """The distributions (name -> version) pip installs for the device's two pins on Python 3.12, from PyPI."""
    empty = Path(tempfile.mkdtemp())
    (empty / "constraints.txt").write_text("")
    items = _dry_run(DEVICE_PYTHON, list(DEVICE_STACK_REQUIREMENTS), [], empty / "constraints.txt", offline=False)
    return dict(sorted((canonical(i["metadata"]["name"]), i["metadata"]["version"]) for i in items))


def _installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}


def provided_stack(python: str, runs: list[Run]) -> dict[str, str]:
    """The device's distributions minus what the runs carry: the device's versions for Python 3.12 (whatever
    runs this: that bundle is the device's); for another version, this interpreter's own, the versions it has
    installed of those names (the CPU run of the check)."""
    stack = json.loads(DEVICE_STACK_FILE.read_text())["distributions"]
    carried = {requirement_name(r) for run in runs for r in run.requirements}
    if python == _this_python() and python != DEVICE_PYTHON:
        installed = _installed()
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


INDEX_TROUBLE = ("Retrying", "Could not fetch URL", "ConnectionError", "ProxyError", "SSLError", "NewConnectionError")


def _megatron_wheel_exists(python: str, version: str) -> bool:
    """Whether the index has a megatron-core ``version`` wheel for ``python`` (its metadata only, not the wheel).
    Only pip's "No matching distribution" for a project whose other releases it saw means no; an index it could
    not read (network, proxy, outage: it then sees no release at all) is refused in one line."""
    with tempfile.TemporaryDirectory() as scratch:
        args = ["install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps", *target_tags(python), "--target", scratch]
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
        env.pop("PIP_FIND_LINKS", None)
        command = [*pip_command(), *args, f"megatron-core=={version}"]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode == 0:
        return True
    if "No matching distribution found" in result.stderr and "(from versions: none)" not in result.stderr:
        return False
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()] or [f"pip exited {result.returncode}"]
    trouble = next((line for line in lines if any(word in line for word in INDEX_TROUBLE)), None)
    none_seen = "pip saw no release of megatron-core at all" if "(from versions: none)" in result.stderr else None
    reason = trouble or none_seen or lines[-1]
    raise SystemExit(f"gpu_bundle: could not ask the package index for megatron-core {version} (Python {python}): "
                     f"{reason[:300]}; check the network, the proxy or PIP_INDEX_URL and run it again")  # fmt: skip


def runs_for(python: str) -> tuple[list[Run], list[str]]:
    """The runs whose megatron-core has a wheel for ``python``, and the releases without one. The device's bundle
    carries every leg's release (one without a cp312 wheel is refused); an interpreter's own CPU bundle drops those
    it cannot install, but not all of them."""
    runs, skipped = [], []
    for run in leg_runs():
        if _megatron_wheel_exists(python, run.megatron_core):
            runs.append(run)
        elif python == DEVICE_PYTHON:
            raise SystemExit(f"gpu_bundle: megatron-core {run.megatron_core} ({LEG_REQUIREMENTS[run.leg].name}) has no "
                             f"wheel for the GPU host (CPython {python}, manylinux x86-64); pin a release that has one")  # fmt: skip
        else:
            skipped.append(run.megatron_core)
    if not runs:
        raise SystemExit(f"gpu_bundle: no leg's megatron-core ({', '.join(skipped)}) has a wheel for Python {python}; "
                         f"nothing to check with it (build --python {DEVICE_PYTHON})")  # fmt: skip
    return runs, skipped


def working_tree_mib() -> float:
    """What the device tool sends beside the bundle: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")  # fmt: skip
    return sum((REPO / name).stat().st_size for name in listed if name and (REPO / name).is_file()) / 2**20


def _versions_of(items: list[dict], stack: dict[str, str]) -> dict[str, str]:
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items if canonical(i["metadata"]["name"]) not in stack}


def _clear(folder: Path) -> None:
    """A full build starts from an empty folder: no wheel of an earlier build's pins or folders stays beside the
    new ones (the check installs every wheel of a run, and pip refuses two of one name)."""
    for wheel in folder.glob("*.whl"):
        wheel.unlink()
    for own in folder.glob("megatron-core-*"):
        shutil.rmtree(own)


def _one_wheel_per_name(folder: Path, version: str) -> None:
    """What scripts/gpu_check.sh installs for the run of megatron-core ``version`` holds one wheel per name."""
    wheels = [w for w in folder.glob("*.whl") if not w.name.startswith("megatron_core-")]
    wheels += [*folder.glob(f"megatron_core-{version}-*.whl"), *(folder / f"megatron-core-{version}").glob("*.whl")]
    names = Counter(canonical(w.name.split("-")[0]) for w in wheels)
    if twice := sorted(name for name, count in names.items() if count > 1):
        raise SystemExit(f"gpu_bundle: {folder}: the megatron-core {version} run would install two wheels of "
                         f"{', '.join(twice)}; delete {folder} and build it again")  # fmt: skip


def build(python: str, dest: Path, resolve_only: bool = False) -> dict:
    """Resolve against PyPI; unless ``resolve_only``, download, check offline and measure. Returns the folder's
    summary, also written as ``bundle.json`` (``plan.json`` when ``resolve_only``)."""
    folder = dest / f"cp{python.replace('.', '')}"
    folder.mkdir(parents=True, exist_ok=True)
    runs, skipped = runs_for(python)
    stack = provided_stack(python, runs)
    built_names = {requirement_name(r) for r in BUILT_HERE}
    with tempfile.TemporaryDirectory() as scratch:
        constraints = write_stand_ins(stack, Path(scratch) / "stand_ins")
        stand_ins = Path(scratch) / "stand_ins"
        if not resolve_only:
            _clear(folder)
        planned, files = {}, {}
        for run in runs:
            links = [stand_ins]
            # every run carries omegaconf (CONFIG_NEEDS); pure Python, so the wheel built by this interpreter installs on any
            built = Path(scratch) / "built" if resolve_only else folder / f"megatron-core-{run.megatron_core}"
            _pip("wheel", "--quiet", "--no-deps", "-w", str(built), *BUILT_HERE)
            links.append(built)
            items = _dry_run(python, list(run.requirements), links, constraints, offline=False)
            planned[run.megatron_core] = _versions_of(items, stack)
            files[run.megatron_core] = sorted(Path(i["download_info"]["url"]).name for i in items if canonical(i["metadata"]["name"]) not in stack)
        bridge = next(({"requirement": r.megatron_bridge, "with_megatron_core": r.megatron_core} for r in runs if r.megatron_bridge), None)
        summary = {"python": python, "megatron_core": [run.megatron_core for run in runs], "megatron_core_without_a_wheel": skipped,
                   "legs": {run.megatron_core: LEG_REQUIREMENTS[run.leg].name for run in runs}, "megatron_bridge": bridge,
                   "carried": planned, "files": files}  # fmt: skip
        if resolve_only:
            (folder / "plan.json").write_text(json.dumps(summary, indent=2) + "\n")
            return summary
        common = set.intersection(*({f"{n}=={v}" for n, v in p.items() if n != "megatron-core" and n not in built_names}
                                    for p in planned.values()))  # fmt: skip
        args = ["download", "--quiet", "--no-deps", *target_tags(python)]
        if common:
            _pip(*args, "-d", str(folder), *sorted(common))
        for run in runs:  # a run's own wheels: its megatron-core, and what only it needs
            _pip(*args, "-d", str(folder), f"megatron-core=={run.megatron_core}")
            own = sorted(f"{n}=={v}" for n, v in planned[run.megatron_core].items()
                         if n != "megatron-core" and n not in built_names and f"{n}=={v}" not in common)  # fmt: skip
            own += [run.megatron_bridge] if run.megatron_bridge else []  # without its declared dependencies, as its leg
            if own:
                _pip(*args, "-d", str(folder / f"megatron-core-{run.megatron_core}"), *own)
        # Offline, from the folder and the stand-ins only: every run's requirements and dependencies resolve.
        resolved = {}
        for run in runs:
            own = folder / f"megatron-core-{run.megatron_core}"
            _one_wheel_per_name(folder, run.megatron_core)
            items = _dry_run(python, list(run.requirements), [folder, own, stand_ins], constraints, offline=True)
            from_bundle = sorted(Path(i["download_info"]["url"]).name for i in items if canonical(i["metadata"]["name"]) not in stack)
            provided = sorted(canonical(i["metadata"]["name"]) for i in items if canonical(i["metadata"]["name"]) in stack)
            resolved[run.megatron_core] = {"from_bundle": from_bundle, "from_the_host": provided}
    wheels = sorted(folder.rglob("*.whl"))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    summary.update(wheels=[str(w.relative_to(folder)) for w in wheels], mib=round(mib, 2), resolved_offline=resolved,
                   working_tree_mib=round(working_tree_mib(), 2))  # fmt: skip
    (folder / "bundle.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def link_device_site(site: Path) -> list[str]:
    """``site``: symlinks to this interpreter's installed files of the device's distributions, nothing else (the
    CPU run of the check imports from exactly the set of packages the GPU host has, plus the bundle)."""
    site.mkdir(parents=True, exist_ok=True)
    device = json.loads(DEVICE_STACK_FILE.read_text())
    names = set(device["distributions"]) | set(device["also_on_the_device"])
    linked = []
    for dist in importlib.metadata.distributions():
        if not dist.metadata["Name"] or canonical(dist.metadata["Name"]) not in names or not dist.files:
            continue
        base = Path(dist.locate_file(""))
        for top in sorted({f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".."}):
            if top.endswith(".pth") or top == "__pycache__" or not (base / top).exists() or (site / top).exists():
                continue
            (site / top).symlink_to(base / top)
        linked.append(canonical(dist.metadata["Name"]))
    return sorted(linked)


def _pythons(asked: list[str] | None) -> list[str]:
    """The versions to build for: those asked, else the device's and, where it has torch (it could not run the
    CPU check without), this interpreter's. Asking for this interpreter's without torch is refused."""
    has_torch = "torch" in _installed()
    if asked:
        if _this_python() in asked and _this_python() != DEVICE_PYTHON and not has_torch:
            raise SystemExit(f"gpu_bundle: --python {_this_python()} is for the CPU run of the check, and this interpreter "
                             f"({sys.executable}) has no torch; run it with the project's venv: .venv/bin/python")  # fmt: skip
        return asked
    if not has_torch:
        print(f"gpu_bundle: {sys.executable} has no torch, so no bundle for its CPU run (Python {_this_python()}); "
              "run .venv/bin/python scripts/gpu_bundle.py for that one")
        return [DEVICE_PYTHON]
    return sorted({DEVICE_PYTHON, _this_python()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="Python version(s) to build for (default: 3.12 and this one)")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the bundle's root folder (default .gpu_bundle)")
    parser.add_argument("--resolve-only", action="store_true", help="resolve against PyPI and write plan.json; download nothing")
    parser.add_argument("--resolve-device-stack", action="store_true", help="rewrite gpu_device_stack.json's resolved part from PyPI")
    parser.add_argument("--device-site", type=Path, help="only link this interpreter's device packages into DIR")
    args = parser.parse_args()
    if args.device_site is not None:
        print(f"gpu_bundle: linked {len(link_device_site(args.device_site))} distributions into {args.device_site}")
        return 0
    if args.resolve_device_stack:
        stack = json.loads(DEVICE_STACK_FILE.read_text())
        stack.update(requirements=list(DEVICE_STACK_REQUIREMENTS), distributions=resolve_device_stack())
        DEVICE_STACK_FILE.write_text(json.dumps(stack, indent=2) + "\n")
    status = 0
    for python in _pythons(args.python):
        tag = "cp" + python.replace(".", "")
        summary = build(python, args.dest, resolve_only=args.resolve_only)
        for version in summary["megatron_core_without_a_wheel"]:
            print(f"gpu_bundle: {tag}: megatron-core {version} has no wheel for Python {python}; not checked there")
        if args.resolve_only:
            for version, packages in summary["carried"].items():
                print(f"gpu_bundle: {tag} megatron-core {version} carries {len(packages)} distributions"
                      + (f" and {summary['megatron_bridge']['requirement']}" if version == (summary["megatron_bridge"] or {}).get("with_megatron_core") else ""))
            continue
        for version, resolved in summary["resolved_offline"].items():
            print(f"gpu_bundle: {tag} megatron-core {version}: resolves offline with "
                  f"{len(resolved['from_bundle'])} wheels of the bundle and {len(resolved['from_the_host'])} of the host")
        carried = python == DEVICE_PYTHON
        total = summary["mib"] + summary["working_tree_mib"]
        verdict = f"with the working tree {total:.1f} MiB, {'under' if total < CARRY_LIMIT_MIB else 'OVER'} the {CARRY_LIMIT_MIB} MiB carry limit"
        print(f"gpu_bundle: {args.dest / tag}: {len(summary['wheels'])} wheels, {summary['mib']:.1f} MiB" + (f"; {verdict}" if carried else ""))
        if carried and total >= CARRY_LIMIT_MIB:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
