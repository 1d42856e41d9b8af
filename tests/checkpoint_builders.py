"""Builders the checkpoint tests share: a trained and saved step, and the hostile edits made to one."""

from __future__ import annotations

import json
import os

import torch

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from verl.utils.checkpoint.integrity import build_manifest


class CreatesFile:
    """Unpickled by anything but an allow-list, this opens (creates) ``marker``: the stand-in for any command."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def edit_manifest(step: str, edit) -> None:
    """``edit`` applied to the step's ``manifest.json`` in place (its checksums are not recomputed)."""
    path = os.path.join(step, "manifest.json")
    manifest = json.loads(open(path).read())
    edit(manifest)
    open(path, "w").write(json.dumps(manifest))


def rewrite_manifest(step: str) -> None:
    """The step's manifest recomputed from what is on disk: a tamperer who re-hashes what they changed."""
    with open(os.path.join(step, "manifest.json"), "w") as handle:
        json.dump(build_manifest(step), handle)


def entry_outside_the_step(step: str) -> str:
    """A manifest entry naming a real file outside the step, with its true size and checksum; returns the
    problem verify reports."""
    outside = os.path.join(os.path.dirname(os.path.dirname(step)), "outside.txt")
    open(outside, "w").write("not part of the step")
    from verl.utils.checkpoint.integrity import file_checksum

    entry = {"size": os.path.getsize(outside), "checksum": file_checksum(outside)}
    edit_manifest(step, lambda m: m["files"].update({"../../outside.txt": entry}))
    return "entry '../../outside.txt' lies outside the step"


def craft_metadata(step: str, marker: str) -> str:
    """``optimizer/dist_ckpt/.metadata`` replaced by a crafted pickle, its manifest entry re-hashed."""
    import pickle

    path = os.path.join(step, "optimizer", "dist_ckpt", ".metadata")
    with open(path, "wb") as handle:
        pickle.dump(CreatesFile(marker), handle)
    rewrite_manifest(step)
    return path


def train_and_save(src: str, root: str) -> None:
    """One training step of the model at ``src`` saved as ``<root>/dc_<use_dist_checkpointing>/global_step_1/actor``
    in both model formats (and the first exported to ``<root>/export``); run on ranks by ``run_on_ranks``."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    batch = torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))
    for use_dist_checkpointing in (True, False):
        configs = actor_configs(
            src,
            override("megatron.use_dist_checkpointing", use_dist_checkpointing),
            "checkpoint.save_contents=[model,optimizer,extra]",
            total_training_steps=TRAINING_STEPS,
        )
        actor = MegatronEngine(*configs)
        actor.train_step([batch])
        actor.save_checkpoint(os.path.join(root, f"dc_{use_dist_checkpointing}", "global_step_1", "actor"), global_step=1)
        if use_dist_checkpointing:
            actor.export_hf(os.path.join(root, "export"))
