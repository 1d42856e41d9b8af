"""Shared fixtures: tiny HF models made locally (no hub)."""

import pytest

from verl.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory) -> str:
    """Qwen3-MoE, 4 layers, 8 experts, norm_topk_prob=True, sharded safetensors + index, tokenizer."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_moe")), kind="moe")


@pytest.fixture(scope="session")
def tiny_dense_path(tmp_path_factory) -> str:
    """Dense Qwen3, 4 layers, sharded safetensors + index, tokenizer."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_dense")), kind="dense")
