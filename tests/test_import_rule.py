"""The import rule of docs/design.md ("Which package imports which"), enforced on every module of ``verl/``.

Each ``verl`` import (module level or inside a function: a lazy import still ties the layers) is checked
against ``ALLOWED``; the two exceptions upstream's layout brings are listed by module, not by layer.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

REPO = pathlib.Path(__file__).resolve().parent.parent

# layer -> the layers it may import besides its own; the layer of ``verl.X...`` is ``X``.
ALLOWED: dict[str, set[str]] = {
    "base_config": set(),
    "utils": {"base_config"},
    "models": {"utils", "base_config"},
    "single_controller": {"utils", "base_config"},
    "model_merger": {"models", "utils", "base_config"},
    "workers": {"models", "single_controller", "utils", "base_config"},
    "trainer": {"workers", "models", "single_controller", "model_merger", "utils", "base_config"},
}
# (importing module prefix, imported module prefix): upstream's layout, kept for its names (docs/design.md).
EXCEPTIONS = {
    ("verl.workers.actor", "verl.trainer.ppo.core_algos"),
    ("verl.workers.config", "verl.trainer.config"),
}
# verl/utils/internals/ (one adapter per dependency) imports no other verl package.
SELF_CONTAINED = "verl.utils.internals"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")[: len(module.split(".")) - node.level + int(is_package)]
                found.append((node.lineno, ".".join(package + ([node.module] if node.module else []))))
            elif node.module:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name == "verl" or name.startswith("verl.")]


def _allowed(importer: str, imported: str) -> bool:
    if importer.startswith(SELF_CONTAINED):
        return imported.startswith(SELF_CONTAINED)
    source, target = importer.split(".")[1:2], imported.split(".")[1:2]
    if not source or not target or source == target:  # the package root itself, or the same layer
        return True
    if any(importer.startswith(a) and imported.startswith(b) for a, b in EXCEPTIONS):
        return True
    return target[0] in ALLOWED.get(source[0], set())


def import_rule_violations(root: pathlib.Path) -> list[str]:
    """``path:line: importer imports imported`` for each import of a module under ``root/verl`` that breaks the rule."""
    problems = []
    for path in sorted((root / "verl").rglob("*.py")):
        module = _module_name(path, root)
        for line, imported in _imported(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            if not _allowed(module, imported):
                problems.append(f"{path.relative_to(root)}:{line}: {module} imports {imported}")
    return problems


def test_every_layer_of_the_package_keeps_the_import_rule():
    assert import_rule_violations(REPO) == []


def test_every_layer_is_in_the_table():
    layers = {p.name.removesuffix(".py") for p in (REPO / "verl").iterdir() if p.name != "__init__.py" and not p.name.startswith("__")}
    assert layers == set(ALLOWED)


def test_an_upward_import_is_reported(tmp_path):
    shutil.copytree(REPO / "verl", tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    integrity = tmp_path / "verl" / "utils" / "checkpoint" / "integrity.py"
    integrity.write_text(integrity.read_text() + "\n\ndef _late():\n    from verl.models.support import hf_config_problems\n")
    internals = tmp_path / "verl" / "utils" / "internals" / "torch.py"
    internals.write_text(internals.read_text() + "\nfrom verl.utils import fs\n")
    problems = import_rule_violations(tmp_path)
    assert len(problems) == 2
    assert any(p.endswith("verl.utils.checkpoint.integrity imports verl.models.support") for p in problems)
    assert any(p.endswith("verl.utils.internals.torch imports verl.utils") for p in problems)
