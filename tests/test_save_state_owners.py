"""Each piece of a save's state is written by one module (per layer where each layer keeps its own): read from the
AST of every module under ``verl/``, so a second writer fails here before it can disagree with the first.

A write is an assignment to ``<anything>.<name>`` (plain, augmented, annotated, in a tuple, or to an item of it) or
a mutating call on it (``append``, ``update``, ...). Names are matched, not types: a name another class also uses
for something else is listed with that module and why."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
MANAGER = "verl/utils/checkpoint/megatron_checkpoint_manager.py"
TRANSACTION = "verl/utils/checkpoint/step_commit.py"
ENGINE = "verl/workers/engine/megatron/transformer_impl.py"

OWNERS = {
    # upstream's retention list, kept for a direct call of the manager; the step transaction lists the disk instead
    "previous_saved_paths": {"verl/utils/checkpoint/checkpoint_manager.py"},
    # the manager's save report (SaveReport)
    **dict.fromkeys(
        ("last_save", "failure", "blocked_seconds", "hf_exported", "checked_in_background",
         "planned_in_background", "hf_weights_in_background", "sealer", "hf_comm"),
        {MANAGER},
    ),  # fmt: skip
    # the manager's one marker of a save in flight; the torch optimizer's per-parameter ``state`` shares only the
    # name (a load's placeholder moments are removed from it)
    "state": {MANAGER, "verl/utils/checkpoint/megatron_optimizer_state.py"},
    # each report's own phases: the manager's (the writer's phases) and the transaction's
    "phase_seconds": {MANAGER, TRANSACTION},
    # the transaction's marker of a deferred commit and its committed record
    "deferred": {TRANSACTION},
    "committed": {TRANSACTION},
    # the engine's record of the last committed step (the writer's phases and the transaction's, merged there)
    "last_committed": {ENGINE},
    # one pending save per layer: the driver's and the engine's; the sealer's futures share only the name
    "_pending": {"verl/trainer/ppo/ray_trainer.py", ENGINE, "verl/utils/checkpoint/durability.py"},
}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault"}


def _written_names(node: ast.AST) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
    names = []

    def collect(target: ast.AST) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                collect(element)
        elif isinstance(target, ast.Attribute):
            names.append(target.attr)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
            names.append(target.value.attr)

    for target in targets:
        collect(target)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute):
        names.append(node.func.value.attr)
    return names


def state_writers(root: pathlib.Path, names: set[str]) -> dict[str, set[str]]:
    """name -> the modules (paths relative to ``root``) under ``root/verl`` that write ``<anything>.<name>``."""
    writers: dict[str, set[str]] = {name: set() for name in names}
    for path in sorted((root / "verl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _written_names(node):
                if name in writers:
                    writers[name].add(path.relative_to(root).as_posix())
    return writers


def test_each_piece_of_save_state_has_its_one_writer():
    assert state_writers(REPO, set(OWNERS)) == OWNERS


def test_a_second_writer_is_found(tmp_path):
    module = tmp_path / "verl" / "intruder.py"
    module.parent.mkdir()
    module.write_text("def f(report, manager):\n    report.state, x = 1, 2\n    manager.previous_saved_paths.append('p')\n    report.phase_seconds['a'] += 1\n")
    assert state_writers(tmp_path, {"state", "previous_saved_paths", "phase_seconds", "deferred"}) == {
        "state": {"verl/intruder.py"}, "previous_saved_paths": {"verl/intruder.py"}, "phase_seconds": {"verl/intruder.py"}, "deferred": set(),
    }  # fmt: skip
