"""The trainer reads its config as typed fields: outside the config builders no module of ``verl/trainer/`` reads the
composed Hydra config itself (the AST rule here), so a key is parsed, checked and defaulted in one place.

A read rooted at a name called ``config`` / ``cfg`` (or ``self.config``) must start with a ``RunConfig`` field or
property, and ``actor_rollout_ref`` (the worker's config, a dict of typed configs) is read through its keys; no
module outside the builders imports omegaconf (``OmegaConf.select`` / ``to_container`` are raw reads).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from verl.trainer.run_config import RunConfig

REPO = pathlib.Path(__file__).resolve().parent.parent
# The modules that turn the Hydra config into typed configs, or check it before they do.
BUILDERS = {
    "verl/trainer/run_config.py",
    "verl/trainer/validation.py",
    "verl/trainer/upstream_keys.py",
    "verl/trainer/ignored_keys.py",
    "verl/trainer/cli_overrides.py",
}
BUILDER_PACKAGES = ("verl/trainer/config/",)
# Hydra's entry point: it receives the composed config and only hands it to the builders (it reads none of it).
ENTRY_POINTS = {"verl/trainer/main_ppo.py"}
RUN_CONFIG_NAMES = {f.name for f in dataclasses.fields(RunConfig)} | {
    name for name, value in vars(RunConfig).items() if isinstance(value, property) or (callable(value) and not name.startswith("_"))
}


def _config_root(node: ast.AST) -> bool:
    """``config`` / ``cfg``, or ``self.config``."""
    if isinstance(node, ast.Name):
        return node.id in ("config", "cfg")
    return isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) and node.value.id == "self"


def raw_reads(source: str, entry_point: bool = False) -> list[tuple[int, str]]:
    """(line, what) for each read of the Hydra config in ``source``; in an ``entry_point``, whose ``config`` is the
    composed Hydra config itself, any read of it, and an omegaconf import is allowed (``hydra.main`` needs it)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, f"imports {name}") for name in names if name.split(".")[0] == "omegaconf" and not entry_point]
        elif entry_point and isinstance(node, ast.Attribute) and _config_root(node.value):
            found.append((node.lineno, f"reads .{node.attr} of the Hydra config"))
        elif isinstance(node, ast.Attribute) and _config_root(node.value) and node.attr not in RUN_CONFIG_NAMES:
            found.append((node.lineno, f"reads .{node.attr}"))
        elif isinstance(node, ast.Subscript) and _config_root(node.value):
            found.append((node.lineno, "reads a key by subscript"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "actor_rollout_ref" and _config_root(node.value.value):
            found.append((node.lineno, f"reads actor_rollout_ref.{node.attr} (a Hydra node; the run's is read by key)"))
    return sorted(found)


def config_read_violations(root: pathlib.Path) -> list[str]:
    problems = []
    for path in sorted((root / "verl" / "trainer").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative in BUILDERS or relative.startswith(BUILDER_PACKAGES):
            continue
        problems += [f"{relative}:{line}: {what}" for line, what in raw_reads(path.read_text(), relative in ENTRY_POINTS)]
    return problems


def test_no_module_of_the_trainer_reads_the_hydra_config_outside_the_builders():
    assert config_read_violations(REPO) == []


def test_a_raw_read_is_reported():
    source = (
        "from omegaconf import OmegaConf\n"
        "def f(config, run):\n"
        "    a = config.trainer.save_freq\n"  # a RunConfig field: typed
        "    b = config.ray_kwargs.ray_init\n"
        "    c = config['data']\n"
        "    d = config.actor_rollout_ref.actor.megatron\n"
        "    e = config.actor_rollout_ref['actor']\n"  # the worker's dict, by key
        "    return OmegaConf.select(config, 'x')\n"
    )
    assert raw_reads(source) == [
        (1, "imports omegaconf"),
        (4, "reads .ray_kwargs"),
        (5, "reads a key by subscript"),
        (6, "reads actor_rollout_ref.actor (a Hydra node; the run's is read by key)"),
    ]
    assert raw_reads(source, entry_point=True) == [
        (3, "reads .trainer of the Hydra config"),
        (4, "reads .ray_kwargs of the Hydra config"),
        (5, "reads a key by subscript"),
        (6, "reads .actor_rollout_ref of the Hydra config"),
        (6, "reads actor_rollout_ref.actor (a Hydra node; the run's is read by key)"),
        (7, "reads .actor_rollout_ref of the Hydra config"),
    ]
