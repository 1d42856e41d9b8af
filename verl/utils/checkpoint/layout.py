"""Every name and relative path of a saved step, defined once: the on-disk layout as data.

Pure and torch-free on purpose: the config checks, the driver's run control and the model merger read
tracker and step directories before any rank starts. Nothing here creates a directory; upstream verl's
``get_*_path`` helpers (``verl.utils.megatron_utils``) are the creating wrappers over these names.

    <root>/                                  trainer.default_local_dir
        latest_checkpointed_iteration.txt    the tracker: the step a resume loads
        global_step_N/
            data.pt                          the prompt sampler's position (the driver's)
            actor/                           one role's directory (``actor.incomplete`` while staged)
                committed.json  manifest.json
                ckpt_contents.json  transformer_config.json
                model/huggingface/  model/dist_ckpt/  optimizer/dist_ckpt/  extra/dist_ckpt/
"""

from __future__ import annotations

import os
import re

# Upstream verl's tracker (``get_checkpoint_tracker_filename``): the step a resume loads.
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# One directory per saved step under ``trainer.default_local_dir``: ``global_step_N``.
STEP_DIR_FORMAT = "global_step_{}"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
# The driver's file beside the roles' directories: the prompt sampler's position.
DATA_STATE_FILENAME = "data.pt"

# A role's directory while its parts are written, and an older copy of the step while it is replaced.
STAGING_SUFFIX = ".incomplete"
SUPERSEDED_SUFFIX = ".superseded"
# Ours, written by the step transaction: the commit mark, then the manifest of every other file.
COMMIT_MARK_FILENAME = "committed.json"
MANIFEST_FILENAME = "manifest.json"
# Upstream verl's files in a role's directory: the contents file (``get_checkpoint_contents_manifest_path``:
# what was saved, where, in which format) and the model's TransformerConfig.
CONTENTS_FILENAME = "ckpt_contents.json"
TRANSFORMER_CONFIG_FILENAME = "transformer_config.json"

# Upstream's v2 content directories, relative to a role's directory.
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
EXTRA_DIR = "extra"
DIST_CKPT_DIRNAME = "dist_ckpt"
HF_DIRNAME = "huggingface"
HF_DIR = f"{MODEL_DIR}/{HF_DIRNAME}"  # HF config, tokenizer and weights (the bridge's)
DIST_CKPT_DIRS = {content: f"{content}/{DIST_CKPT_DIRNAME}" for content in (MODEL_DIR, OPTIMIZER_DIR, EXTRA_DIR)}
# The HF safetensors index: written by the parallel HF export, read by the HF completeness check.
INDEX_FILENAME = "model.safetensors.index.json"
# Ours, beside upstream's rng_state in extra/dist_ckpt: every rank's own RNG streams (one ShardedObject per rank).
RANK_RNG_STATE_KEY = "rank_rng_state"
# This package's descriptions of a step's directories in ckpt_contents.json ("directories"; upstream writes its
# own words): one of them in a step without manifest and commit mark tells a damaged step of ours from
# upstream's (``verl.utils.checkpoint.integrity.our_marks``).
DIRECTORY_NOTES = {
    "hf": "HF weights, config, tokenizer and generation config, written through the bridge",
    "model": "Megatron dist-checkpoint shards of the model",
    "optimizer": "Megatron dist-checkpoint shards of the optimizer state and the LR scheduler",
    "extra": "Megatron dist-checkpoint shards of the RNG state",
}


# This package's notes on two contents of ckpt_contents.json (upstream words its own): evidence as DIRECTORY_NOTES.
CONTENT_NOTES = {
    "hf_config": "config.json, tokenizer, generation_config.json",
    "hf_model_beside_dist": "HF export next to the Megatron model shards",
    "hf_model_same_files": "the same files as 'model'",
}
# Ours, in ckpt_contents.json (upstream's readers ignore keys they do not know): what vouches for the step's
# bytes. A save the step transaction commits names the files that will (a step whose contents file says so is
# ours whatever else it lost); a save made in place through the manager's own ``save_checkpoint`` (upstream's
# API, no transaction) says that nothing does, so it loads as upstream's step would.
INTEGRITY_KEY = "integrity"
INTEGRITY_NOTE = {"manifest": MANIFEST_FILENAME, "commit_mark": COMMIT_MARK_FILENAME}
INTEGRITY_IN_PLACE_NOTE = {"saved_in_place": "MegatronCheckpointManager.save_checkpoint outside a step transaction: no manifest"}


def step_dir(root: str, step: int) -> str:
    """``<root>/global_step_<step>``."""
    return os.path.join(root, STEP_DIR_FORMAT.format(step))


def role_dir(root: str, step: int, role: str) -> str:
    """``<root>/global_step_<step>/<role>``: where one role's committed step lies."""
    return os.path.join(step_dir(root, step), role)


def tracker_path(root: str) -> str:
    """``<root>/latest_checkpointed_iteration.txt``."""
    return os.path.join(root, TRACKER_FILENAME)


def staging_path(role_path: str) -> str:
    """Where the parts of ``role_path`` are written before the commit renames them into place."""
    return role_path.rstrip("/") + STAGING_SUFFIX


def is_staging_path(path: str) -> bool:
    """Whether ``path`` is a staging directory: its parts are committed by the step transaction, not in place."""
    return os.path.normpath(path).endswith(STAGING_SUFFIX)


def superseded_path(path: str) -> str:
    """Where a committed role directory or step file waits while a re-save of its step replaces it, until that
    commit ends."""
    return path.rstrip("/") + SUPERSEDED_SUFFIX


def hf_path(role_path: str) -> str:
    """``<role_path>/model/huggingface``."""
    return os.path.join(role_path, HF_DIR)


def dist_path(role_path: str, content: str) -> str:
    """``<role_path>/<content>/dist_ckpt`` for content ``model``, ``optimizer`` or ``extra``."""
    return os.path.join(role_path, DIST_CKPT_DIRS[content])


def list_step_dirs(root_path: str) -> list[tuple[int, str]]:
    """All ``global_step_N`` directories under ``root_path``, oldest first (step number, path); reads, creates nothing."""
    if not os.path.isdir(root_path):
        return []
    steps = []
    for name in os.listdir(root_path):
        match = STEP_DIR_RE.match(name)
        if match and os.path.isdir(os.path.join(root_path, name)):
            steps.append((int(match.group(1)), os.path.join(root_path, name)))
    return sorted(steps)


def checkpoint_root_problem(path: str, key: str) -> str | None:
    """Why a save could not create or write ``path`` (the checkpoint root ``key`` names), or None."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{key}={path} is a file; set {key} to a directory"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        return f"{key}={path} cannot be created ({existing} is not a writable directory); set {key}"
    return None


def resume_step_problem(path: str, key: str, role: str = "actor") -> str | None:
    """Why ``path`` (named by ``key``) is not a saved, complete ``global_step_N`` to resume from, or None."""
    path = os.path.abspath(os.path.expanduser(path))
    if not STEP_DIR_RE.match(os.path.basename(path.rstrip("/"))):
        return f"{key}={path} is not a global_step_N directory; point it at one"
    if not os.path.isdir(path):
        return f"{key}={path} does not exist; set {key} to a saved global_step_N directory"
    if not os.path.isfile(os.path.join(path, role, CONTENTS_FILENAME)):
        return f"{key}={path} holds no complete {role} checkpoint ({role}/{CONTENTS_FILENAME} is missing: an interrupted save?); choose another step"
    return None
