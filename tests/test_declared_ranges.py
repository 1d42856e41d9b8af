"""setup.py declares only what a leg of scripts/test.sh runs: every leg's pin lies inside the declared range, and
each end of a declared range is a release some leg pins (so an end that never ran cannot be declared, and a leg's
pin cannot drift out of what users are told).

The legs: requirements.txt (Python 3.11), the transformers 4.57 leg (requirements.txt with scripts/test.sh's
transformers pin) and requirements-py312.txt (Python 3.12, Megatron-Bridge as setup.py's extra).
"""

import ast
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parent.parent
PIN = r"([A-Za-z0-9_.-]+)==([0-9][0-9.]*)"


def _setup_names() -> dict:
    """setup.py's module-level literals (DECLARED, EXTRAS, PYTHON_REQUIRES), read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and node.targets[0].id.isupper()}  # fmt: skip


def _file_pins(name: str) -> dict[str, str]:
    return {k.lower(): v for k, v in re.findall(rf"^{PIN}", (REPO / name).read_text(), re.MULTILINE)}


def _legs() -> dict[str, dict[str, str]]:
    """leg -> package -> the exact release it installs."""
    main, py312 = _file_pins("requirements.txt"), _file_pins("requirements-py312.txt")
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    transformers4 = re.search(r'"transformers==([0-9.]+)"', test_sh).group(1)
    python312 = re.search(r"versions/([0-9.]+)/bin/python3", test_sh).group(1)
    return {
        "requirements.txt": {**main, "python": "3.11"},
        "transformers 4.57 leg": {**main, "transformers": transformers4, "python": "3.11"},
        "requirements-py312.txt": {**py312, "python": python312},
    }


def _ranges() -> dict[str, SpecifierSet]:
    names = _setup_names()
    ranges = {package: SpecifierSet(spec) for package, spec in names["DECLARED"].items()}
    for requirement in (Requirement(line) for extra in names["EXTRAS"].values() for line in extra):
        if any(spec.operator == "==" for spec in requirement.specifier):
            ranges[requirement.name.lower()] = requirement.specifier
    ranges["python"] = SpecifierSet(names["PYTHON_REQUIRES"])
    return ranges


def test_every_legs_pin_lies_inside_the_declared_range():
    ranges, outside = _ranges(), []
    for leg, pins in _legs().items():
        outside += [f"{leg}: {name} {pins[name]} not in {spec}" for name, spec in ranges.items() if name in pins and pins[name] not in spec]
    assert not outside, outside
    assert "megatron-bridge" in ranges and "megatron-bridge" in _legs()["requirements-py312.txt"]  # the extra is held too


def test_each_end_of_a_declared_range_is_a_release_a_leg_runs():
    run: dict[str, set[str]] = {}
    for pins in _legs().values():
        for name, version in pins.items():
            run.setdefault(name, set()).add(version)
    never_run = [f"{name}: {end} (run: {sorted(run.get(name, ()))})" for name, spec in _ranges().items()
                 for end in spec if end.operator != "!=" and not _end_ran(name, end, run.get(name, set()))]  # fmt: skip
    assert not never_run, never_run


def _end_ran(name: str, end, run: set[str]) -> bool:
    """An inclusive end (``>=``, ``<=``, ``==``) is a release a leg runs. Python's are minors: ``>=3.11`` ran when a
    3.11 leg did, ``<3.13`` when a 3.12 one did (the last minor below it)."""
    if name != "python":
        return end.operator in (">=", "<=", "==") and end.version in run
    major, minor = (int(part) for part in end.version.split(".")[:2])
    wanted = {">=": (major, minor), "<": (major, minor - 1)}.get(end.operator)
    return wanted is not None and any(tuple(int(part) for part in seen.split(".")[:2]) == wanted for seen in run)
