"""docs/trainer.md's table of config keys says exactly what the YAML says.

The table is written by hand (it explains each key), so these tests are what keeps it from drifting:
every documented key must exist in ``ppo_megatron_trainer.yaml`` with the documented default, and every
key of the YAML must be documented. The cell grammar is the one the table's preamble states.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "trainer.md"
YAML = ROOT / "verl" / "trainer" / "config" / "ppo_megatron_trainer.yaml"
# Hydra's own settings and the dataclass targets are not user-facing keys.
UNDOCUMENTED_TOP = {"defaults", "hydra"}


def _split_top(cell: str) -> list[str]:
    """Split a cell at , / ; that are outside backticks and brackets (lists and paths keep theirs)."""
    parts, depth, in_tick, current = [], 0, False, ""
    for char in cell:
        if char == "`":
            in_tick = not in_tick
        elif not in_tick and char in "[{":
            depth += 1
        elif not in_tick and char in "]}":
            depth -= 1
        if char in ",/;" and not in_tick and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip().strip("`").strip() for part in parts if part.strip()]


def _expand_keys(cell: str, last_full_parent: str) -> tuple[list[str], str]:
    """The full key paths a key cell names, and the parent that later ``...`` rows continue."""
    keys: list[str] = []
    sibling_parent = ""
    for segment in re.findall(r"`([^`]+)`", cell):
        braces = re.fullmatch(r"(.+)\.\{(.+)\}", segment)
        names = [f"{braces.group(1)}.{name.strip()}" for name in braces.group(2).split(",")] if braces else [segment]
        for name in names:
            if name.startswith("..."):
                assert last_full_parent, f"{segment!r}: '...' before any full key"
                name = f"{last_full_parent}.{name[3:]}"
            elif "." in name:
                last_full_parent = name.rsplit(".", 1)[0]
            else:
                assert sibling_parent, f"{segment!r}: a bare name needs a full key before it in its cell"
                name = f"{sibling_parent}.{name}"
            sibling_parent = name.rsplit(".", 1)[0]
            keys.append(name)
    return keys, last_full_parent


def parse_table(markdown: str) -> dict[str, str]:
    """{full key: documented default} from the table under '## Config keys'."""
    section = markdown.split("## Config keys", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, str] = {}
    last_full_parent = ""
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys, last_full_parent = _expand_keys(cells[0], last_full_parent)
        defaults = _split_top(cells[1])
        if len(defaults) == 1:
            defaults = defaults * len(keys)
        assert len(defaults) == len(keys), f"row {cells[0]}: {len(keys)} keys but defaults {defaults}"
        for key, default in zip(keys, defaults, strict=True):
            assert key not in documented, f"{key} is documented twice"
            documented[key] = default
    return documented


def yaml_leaves(path: Path = YAML) -> dict[str, object]:
    """{dotted key: raw value} of the YAML (interpolations kept as written), without Hydra's keys."""
    leaves: dict[str, object] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if name != "_target_":
                    walk(value, f"{prefix}.{name}" if prefix else name)
        else:
            leaves[prefix] = node

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    walk({name: value for name, value in raw.items() if name not in UNDOCUMENTED_TOP}, "")
    return leaves


def mismatches(documented: dict[str, str], leaves: dict[str, object]) -> list[str]:
    """One line per documented key that is not in the YAML or whose default differs."""
    problems = []
    for key, default in documented.items():
        if key not in leaves:
            problems.append(f"{key}: documented, not in the YAML")
            continue
        actual = leaves[key]
        if default.startswith("="):
            # '= x.y' documents an interpolation ${x.y} (or a relative ${.y}).
            target = default[1:].strip()
            ok = isinstance(actual, str) and re.fullmatch(r"\$\{\.*" + re.escape(target) + r"\}", actual) is not None
        else:
            parsed = OmegaConf.to_container(OmegaConf.create(f"v: {default}"), resolve=False)["v"]
            ok = json.dumps(parsed) == json.dumps(actual)
        if not ok:
            problems.append(f"{key}: documented {default!r}, YAML has {actual!r}")
    return problems


def test_every_documented_default_is_the_yaml_default():
    documented = parse_table(DOC.read_text())
    assert len(documented) >= 40, f"parsed only {len(documented)} keys: did the table's format change?"
    assert mismatches(documented, yaml_leaves()) == []


def test_every_yaml_key_is_documented():
    documented = parse_table(DOC.read_text())
    assert sorted(set(yaml_leaves()) - set(documented)) == []


def test_the_comparison_catches_a_wrong_default_and_an_unknown_key():
    """The checks above are only worth something if a drifted row fails them."""
    table = (
        "## Config keys\n\n| key | default | meaning |\n|---|---|---|\n"
        "| `data.seed` | 2 | x |\n"
        "| `trainer.nnodes`, `n_gpus_per_node` | 1, 4 | x |\n"
        "| `actor_rollout_ref.actor.megatron.seed` | 42 | x |\n"
        "| `...not_a_key` | 1 | x |\n"
        "| `actor_rollout_ref.rollout.response_length` | `= data.max_prompt_length` | x |\n"
    )
    documented = parse_table(table)
    assert documented["trainer.n_gpus_per_node"] == "4"
    assert mismatches(documented, yaml_leaves()) == [
        "data.seed: documented '2', YAML has 1",
        "trainer.n_gpus_per_node: documented '4', YAML has 8",
        "actor_rollout_ref.actor.megatron.not_a_key: documented, not in the YAML",
        "actor_rollout_ref.rollout.response_length: documented '= data.max_prompt_length', YAML has "
        "'${data.max_response_length}'",
    ]
