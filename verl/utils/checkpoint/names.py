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
# The HF safetensors index: written by the parallel HF export, read by the HF completeness check.
INDEX_FILENAME = "model.safetensors.index.json"
