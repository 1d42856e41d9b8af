"""The names of a checkpoint's files and directories, defined once.

Torch-free on purpose: the config checks and the driver's run control read the tracker and step
directories before any rank starts, and importing ``checkpoint_manager`` would pull in torch.
"""

from __future__ import annotations

import re

# Upstream verl's tracker (``get_checkpoint_tracker_filename``): the step a resume loads.
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# One directory per saved step under ``trainer.default_local_dir``: ``global_step_N``.
STEP_DIR_FORMAT = "global_step_{}"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
# Upstream verl's files in a role's directory: the contents file (``get_checkpoint_contents_manifest_path``:
# what was saved, where, in which format) and the model's TransformerConfig.
CONTENTS_FILENAME = "ckpt_contents.json"
TRANSFORMER_CONFIG_FILENAME = "transformer_config.json"
# Ours, beside upstream's rng_state in extra/dist_ckpt: every rank's own RNG streams (one ShardedObject per rank).
RANK_RNG_STATE_KEY = "rank_rng_state"
# The HF safetensors index: written by the parallel HF export, read by the HF completeness check.
INDEX_FILENAME = "model.safetensors.index.json"
# This package's descriptions of a step's directories in ckpt_contents.json ("directories"; upstream writes its
# own words): one of them in a step without manifest and commit mark tells a damaged step of ours from
# upstream's (``verl.utils.checkpoint.integrity.our_marks``).
DIRECTORY_NOTES = {
    "hf": "HF weights, config, tokenizer and generation config, written through the bridge",
    "model": "Megatron dist-checkpoint shards of the model",
    "optimizer": "Megatron dist-checkpoint shards of the optimizer state and the LR scheduler",
    "extra": "Megatron dist-checkpoint shards of the RNG state",
}
