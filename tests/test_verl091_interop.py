"""Checkpoints cross over with verl 0.9.1: what its manager saved resumes here, and ours has its layout.

The fixture under tests/fixtures/verl091 was written by verl 0.9.1's own MegatronCheckpointManager
(interop/verl091_interop.py, in a venv of its own; docs/upstream-interop.md), with the values 0.9.1's own load
of it gives. Here this package's manager loads the same step into a fresh model, optimizer and scheduler, and
every parameter, Adam moment, the Adam step, the LR scheduler, the param groups and the RNG states must equal them.
"""

import json
import os
import shutil
import warnings

import pytest

from interop import verl091_interop as interop  # the harness's own test: its ranks import it by name
from verl.utils.checkpoint.integrity import verify_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "verl091")
LAYOUTS = {"tp1_pp1_ep1": (1, 1, 1), "pp2_ep2": (4, 2, 2)}  # name -> (world, pp, ep)


def _copy(layout: str, tmp_path) -> str:
    root = tmp_path / layout
    shutil.copytree(os.path.join(FIXTURE, layout), root)
    return str(root / "global_step_2" / "actor")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_verl091_checkpoint_resumes_here_with_every_value(layout, tmp_path):
    world, pp, ep = LAYOUTS[layout]
    ckpt = _copy(layout, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verify_checkpoint(ckpt)  # the pre-load check: an upstream step, without our manifest, is accepted
    assert any("saved by upstream verl" in str(w.message) for w in caught)
    job = {"side": "ours", "action": "load", "pp": pp, "ep": ep, "ckpt": ckpt, "model_path": os.path.join(ckpt, "model", "huggingface")}
    loaded = interop.merge_ranks([r["loaded"] for r in interop.spawn_ranks(job, world)])
    expected = json.load(open(os.path.join(FIXTURE, layout, "expected.json")))["loaded"]
    report = interop.compare(expected, loaded, interop.rng_sources(world, pp))
    assert report["ok"], {k: v for k, v in report.items() if k != "ok"}


def _structure(contents: dict) -> dict:
    """What of ckpt_contents.json a reader depends on: each content's path, format, backend and key."""
    keep = ("path", "format", "backend", "key")
    return {
        "schema_version": contents["schema_version"],
        "framework": contents["framework"],
        "save_contents": contents["save_contents"],
        "backend": contents["backend"],
        "contents": {name: {k: v for k, v in entry.items() if k in keep} for name, entry in contents["contents"].items()},
        "directories": sorted(contents["directories"]),
    }


def _tree(step: str) -> set[str]:
    ours = {"committed.json", "manifest.json"}
    found = set()
    for root, dirs, files in os.walk(step):
        rel = os.path.relpath(root, step)
        found.update(os.path.normpath(os.path.join(rel, d)) for d in dirs if os.listdir(os.path.join(root, d)))
        found.update(os.path.normpath(os.path.join(rel, f)) for f in files if f not in ours and not f.startswith("__"))
    return found


def test_our_save_has_verl091s_layout_and_contents_schema(tmp_path):
    model = str(tmp_path / "model")
    interop.cmd_make_model(type("Args", (), {"out": model})())
    ckpt = str(tmp_path / "ours" / "global_step_2" / "actor")
    interop.spawn_ranks({"side": "ours", "action": "save", "pp": 1, "ep": 1, "ckpt": ckpt, "model_path": model}, 1)
    theirs = os.path.join(FIXTURE, "tp1_pp1_ep1", "global_step_2", "actor")
    # The fixture's tokenizer files are what transformers 4.57 writes; 5.x writes no special_tokens_map.json
    # (its content lives in tokenizer_config.json), for either package.
    tokenizer_only = {"model/huggingface/special_tokens_map.json"}
    assert _tree(ckpt) - tokenizer_only == _tree(theirs) - tokenizer_only
    ours_contents = json.load(open(os.path.join(ckpt, "ckpt_contents.json")))
    their_contents = json.load(open(os.path.join(theirs, "ckpt_contents.json")))
    assert _structure(ours_contents) == _structure(their_contents)
