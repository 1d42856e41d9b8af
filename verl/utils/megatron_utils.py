"""Megatron helpers with upstream verl's names: module device, offload/reload, checkpoint paths."""

from __future__ import annotations

import os

# ---------------------------------------------------------------------------------------------
# Checkpoint layout of one step (upstream verl's), relative to <default_local_dir>/global_step_N/actor:
#   ckpt_contents.json  transformer_config.json
#   model/dist_ckpt/  model/huggingface/  optimizer/dist_ckpt/  extra/dist_ckpt/
# ---------------------------------------------------------------------------------------------


def get_model_checkpoint_path(checkpoint_path: str) -> str:
    return os.path.join(checkpoint_path, "model")


def get_dist_checkpoint_path(checkpoint_path: str) -> str:
    """The model's Megatron dist checkpoint."""
    return os.path.join(checkpoint_path, "model", "dist_ckpt")


def get_hf_model_checkpoint_path(checkpoint_path: str) -> str:
    """The HF export: config.json, tokenizer, generation config, safetensors + index."""
    return os.path.join(checkpoint_path, "model", "huggingface")


def get_optimizer_checkpoint_path(checkpoint_path: str) -> str:
    """Optimizer and LR scheduler, as a Megatron dist checkpoint."""
    return os.path.join(checkpoint_path, "optimizer", "dist_ckpt")


def get_extra_checkpoint_path(checkpoint_path: str) -> str:
    """RNG states (and other small per-rank state), as a Megatron dist checkpoint."""
    return os.path.join(checkpoint_path, "extra", "dist_ckpt")


def get_transformer_config_checkpoint_path(checkpoint_path: str) -> str:
    return os.path.join(checkpoint_path, "transformer_config.json")


def get_ckpt_contents_path(checkpoint_path: str) -> str:
    """Which contents (model, optimizer, extra, hf_model) the step holds."""
    return os.path.join(checkpoint_path, "ckpt_contents.json")
