"""The import rule of docs/design.md ("Which package imports which"), enforced on every module of ``verl/``.

Each ``verl`` import (module level or inside a function: a lazy import still ties the layers) is checked
against ``ALLOWED``; the two exceptions upstream's layout brings are listed by module, not by layer. Inside
``verl/workers/`` the engine (one rank) imports neither Ray's side nor the worker, and the two import paths
from before upstream's engine layout only re-export their new home, which no module of ``verl/`` imports
them for.
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
# (importing module, imported module) inside a layer: the rank's engine runs without Ray and without its worker.
FORBIDDEN = {
    ("verl.workers.engine", "verl.single_controller"),
    ("verl.workers.engine", "verl.workers.engine_workers"),
}
# The import paths from before upstream's engine layout (#6067) -> the module they re-export; nothing else in them.
REEXPORTS = {
    "verl.workers.megatron_rank": "verl.workers.engine.megatron.transformer_impl",
    "verl.workers.megatron_workers": "verl.workers.engine_workers",
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


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
    if any(_under(importer, a) and _under(imported, b) for a, b in FORBIDDEN) or imported in REEXPORTS:
        return False
    if importer.startswith(SELF_CONTAINED):
        return imported.startswith(SELF_CONTAINED)
    source, target = importer.split(".")[1:2], imported.split(".")[1:2]
    if not source or not target or source == target:  # the package root itself, or the same layer
        return True
    if any(importer.startswith(a) and imported.startswith(b) for a, b in EXCEPTIONS):
        return True
    return target[0] in ALLOWED.get(source[0], set())


def _not_a_reexport(tree: ast.Module, target: str) -> list[tuple[int, str]]:
    """Statements of an import path other than its docstring, ``__all__`` and imports from ``target``."""
    found = []
    for node in tree.body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        names_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        from_target = isinstance(node, ast.ImportFrom) and node.module == target and not node.level
        if not (docstring or names_all or from_target):
            found.append((node.lineno, type(node).__name__))
    return found


def import_rule_violations(root: pathlib.Path) -> list[str]:
    """``path:line: importer imports imported`` for each import of a module under ``root/verl`` that breaks the
    rule, and ``path:line: module defines <statement>`` for code in an import path that only re-exports."""
    problems = []
    for path in sorted((root / "verl").rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text())
        if module in REEXPORTS:
            problems += [f"{path.relative_to(root)}:{line}: {module} defines {kind}" for line, kind in _not_a_reexport(tree, REEXPORTS[module])]
            continue
        for line, imported in _imported(tree, module, path.name == "__init__.py"):
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


def test_the_engine_and_the_old_import_paths_are_reported(tmp_path):
    shutil.copytree(REPO / "verl", tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    workers = tmp_path / "verl" / "workers"
    engine = workers / "engine" / "megatron" / "transformer_impl.py"
    engine.write_text(engine.read_text() + "\n\ndef _late():\n    from verl.single_controller.base.decorator import register\n")
    old_rank = workers / "megatron_rank.py"
    old_rank.write_text(old_rank.read_text() + "\n\ndef helper():\n    return None\n")
    trainer = tmp_path / "verl" / "trainer" / "ppo" / "ray_trainer.py"
    trainer.write_text(trainer.read_text() + "\nfrom verl.workers.megatron_workers import ActorRolloutRefWorker as _Old\n")
    problems = import_rule_violations(tmp_path)
    assert len(problems) == 3, problems
    assert any(p.endswith("verl.workers.engine.megatron.transformer_impl imports verl.single_controller.base.decorator") for p in problems)
    assert any(p.endswith("verl.workers.megatron_rank defines FunctionDef") for p in problems)
    assert any(p.endswith("verl.trainer.ppo.ray_trainer imports verl.workers.megatron_workers") for p in problems)


# verl/utils/checkpoint/, one level down: each module's floor; a module imports only modules of its own floor
# or below (and no circle, below). Errors and names at the bottom, then the records built on them, the checks,
# the writers, the step transaction and the resume check, and the manager on top: the transaction never
# imports the manager, a check never imports a writer.
CHECKPOINT_FLOORS: dict[str, int] = {
    **dict.fromkeys(("errors", "layout", "async_modes", "check_audit", "dir_lock", "mbridge_config", "megatron_optimizer_state"), 0),
    **dict.fromkeys(("tracker", "names", "checksum", "megatron_metadata", "checkpoint_manager", "os_errors", "megatron_state_dicts", "precision"), 1),
    **dict.fromkeys(("data_only", "hf_verify", "integrity", "finite"), 2),  # checks
    **dict.fromkeys(("dist_writer", "snapshot_save", "forked_save", "save_writers", "durability", "host_copy"), 3),  # writers
    **dict.fromkeys(("step_commit", "resume_check"), 4),  # the step transaction, the resume check
    **dict.fromkeys(("megatron_checkpoint_manager", "megatron_checkpoint_load"), 5),  # the manager
}  # fmt: skip


def checkpoint_import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Each ``verl/utils/checkpoint/`` module (short name) -> the modules of the package it imports (module level
    or inside a function)."""
    package = root / "verl" / "utils" / "checkpoint"
    modules = {_module_name(path, root): path for path in package.glob("*.py") if path.name != "__init__.py"}
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        imported = {name for _, name in _imported(tree, module, False)}
        imported |= {  # ``from verl.utils.checkpoint import layout`` imports the module ``layout``
            f"verl.utils.checkpoint.{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "verl.utils.checkpoint"
            for alias in node.names
        }
        graph[module.rsplit(".", 1)[1]] = {name.rsplit(".", 1)[1] for name in imported if name in modules and name != module}
    return graph


def checkpoint_floor_violations(root: pathlib.Path) -> list[str]:
    """``importer (floor) imports imported (floor)`` for each import up the floors, and a line per module that
    has no floor in ``CHECKPOINT_FLOORS``."""
    graph = checkpoint_import_graph(root)
    problems = [f"{module} has no floor in CHECKPOINT_FLOORS" for module in sorted(graph) if module not in CHECKPOINT_FLOORS]
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            if module in CHECKPOINT_FLOORS and CHECKPOINT_FLOORS.get(other, 0) > CHECKPOINT_FLOORS[module]:
                problems.append(f"{module} ({CHECKPOINT_FLOORS[module]}) imports {other} ({CHECKPOINT_FLOORS[other]})")
    return problems


def checkpoint_import_circles(root: pathlib.Path) -> list[set[str]]:
    """The groups of ``verl/utils/checkpoint/`` modules (short names) that import each other in a circle, found
    as the strongly connected components of the import graph."""
    graph = checkpoint_import_graph(root)
    circles, index, low, stack, counter = [], {}, {}, [], [0]

    def visit(module: str) -> None:
        index[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                circles.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_the_checkpoint_package_keeps_its_floors_and_has_no_import_circle():
    assert checkpoint_floor_violations(REPO) == []
    assert checkpoint_import_circles(REPO) == []


def test_a_checkpoint_import_up_the_floors_or_in_a_circle_is_reported(tmp_path):
    shutil.copytree(REPO / "verl", tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    package = tmp_path / "verl" / "utils" / "checkpoint"
    errors = package / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late():\n    from verl.utils.checkpoint.integrity import read_manifest\n")
    commit = package / "step_commit.py"
    commit.write_text(commit.read_text() + "\n\ndef _late():\n    from verl.utils.checkpoint import megatron_checkpoint_manager\n")
    (package / "unplaced.py").write_text("from verl.utils.checkpoint import layout\n")
    assert checkpoint_floor_violations(tmp_path) == [
        "unplaced has no floor in CHECKPOINT_FLOORS",
        "errors (0) imports integrity (2)",
        "step_commit (4) imports megatron_checkpoint_manager (5)",
    ]
    assert {"errors", "integrity"} <= set().union(*checkpoint_import_circles(tmp_path))


# The rooms outside verl/ (docs/design.md, README's layout): which of this repository's top-level packages each
# may import. verl/ imports none of them; scripts/ (user tools) only verl; the benchmarks verl, their
# shared benchmarks/common.py and the verl 0.9.1 harness they time against; no room imports tests/, and the suite
# imports no room but the harness, from the harness's own test, and the GPU check's requirement helpers.
ROOMS: dict[str, set[str]] = {
    "verl": {"verl"},
    "scripts": {"verl"},
    "benchmarks": {"verl", "benchmarks", "interop"},
    "interop": {"verl", "interop"},
    "tests": {"verl", "tests"},
}
ROOM_EXCEPTIONS = {  # (importing file, imported room)
    ("tests/test_verl091_interop.py", "interop"),
    ("tests/test_upstream_e2e_overrides.py", "interop"),
    ("tests/test_gpu_check.py", "scripts"),
}
# The one file that may extend sys.path: every other import goes through the package a room is.
SYS_PATH_OWNER = "tests/conftest.py"


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines of ``sys.path.<method>(...)`` calls and ``sys.path[...] = ...`` assignments."""
    def is_sys_path(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"

    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_sys_path(n.func.value)]
    lines += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) and is_sys_path(t.value) for t in n.targets)]
    return sorted(lines)


def room_violations(root: pathlib.Path) -> list[str]:
    """``path:line: imports room`` for each absolute import of a room that the importing room may not import,
    and ``path:line: edits sys.path`` for each edit of ``sys.path`` outside ``SYS_PATH_OWNER``."""
    problems = []
    for room, allowed in ROOMS.items():
        for path in sorted((root / room).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
                for imported in {name.split(".")[0] for name in names} & set(ROOMS):
                    if imported not in allowed and (relative, imported) not in ROOM_EXCEPTIONS:
                        problems.append(f"{relative}:{node.lineno}: imports {imported}")
            if relative != SYS_PATH_OWNER:
                problems += [f"{relative}:{line}: edits sys.path" for line in _sys_path_edits(tree)]
    return problems


def test_every_room_imports_only_what_its_audience_needs_and_nothing_edits_sys_path():
    assert room_violations(REPO) == []


def test_a_room_importing_another_or_editing_sys_path_is_reported(tmp_path):
    for room in ROOMS:
        (tmp_path / room).mkdir()
    (tmp_path / "verl" / "late.py").write_text("def _late():\n    from benchmarks.common import make_model\n")
    (tmp_path / "scripts" / "tool.py").write_text("import sys\n\nsys.path.insert(0, '..')\nimport tests.main_leg\n")
    (tmp_path / "tests" / "test_bench.py").write_text("from benchmarks import bench_checkpoint\n")
    (tmp_path / "tests" / "conftest.py").write_text("import sys\n\nsys.path.append('.')\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("import sys\n\nfrom benchmarks.common import MiB\nfrom interop import verl091_interop\nsys.path[:0] = ['x']\n")
    assert sorted(room_violations(tmp_path)) == [
        "benchmarks/bench.py:5: edits sys.path",
        "scripts/tool.py:3: edits sys.path",
        "scripts/tool.py:4: imports tests",
        "tests/test_bench.py:1: imports benchmarks",
        "verl/late.py:2: imports benchmarks",
    ]
