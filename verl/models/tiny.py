"""Tiny HF models and a tokenizer the project makes itself, offline (no hub).

The embedded default of the main job and the tests' fixtures: a Qwen3-MoE (4 layers, 8 experts)
and a dense Qwen3, and one tiny model per other supported family (Llama, Qwen2, Mixtral, Qwen2-MoE),
saved as sharded safetensors with an index, plus a character-level tokenizer.
Norm weights are randomised so a mis-mapped norm cannot hide behind the all-ones default.
"""

from __future__ import annotations

import os
import string

import torch

VOCAB_SIZE = 256
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_tokenizer():
    """A character-level fast tokenizer: digits, letters, punctuation and space."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.digits + string.ascii_letters + string.punctuation + " ")
    vocab = {tok: i for i, tok in enumerate(_SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


# The tiny model kinds: the embedded Qwen3 pair plus one per other supported family (tests/test_model_families.py).
KINDS = ("moe", "dense", "llama", "qwen2", "mixtral", "qwen2_moe")


def tiny_hf_config(kind: str = "moe", num_layers: int = 4, num_experts: int = 8, **overrides):
    """The tiny config of ``kind`` (one of ``KINDS``); ``overrides`` replace any HF config field.

    Mixtral is made as transformers makes it, with ``head_dim`` unset (None), as real Mixtral configs are.
    The kinds that set ``head_dim`` (Qwen3, Qwen3-MoE, Llama) set 32, twice hidden_size / heads: the smallest
    head size vLLM's CPU attention takes (16 fails at the first generate), so the rollout can serve them.
    """
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention: 32, 64, 80, ... (see the docstring)
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    routing = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)
    qwen_moe = dict(
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=num_experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **routing,
    )
    if kind == "moe":
        return Qwen3MoeConfig(**{**common, **qwen_moe, **overrides})
    if kind == "dense":
        return Qwen3Config(**{**common, "intermediate_size": 128, **overrides})
    if kind == "llama":
        return LlamaConfig(**{**common, "intermediate_size": 128, **overrides})
    without_head_dim = {k: v for k, v in common.items() if k != "head_dim"}
    if kind == "qwen2":
        return Qwen2Config(**{**without_head_dim, "intermediate_size": 128, **overrides})
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(**{**without_head_dim, **qwen_moe, "shared_expert_intermediate_size": 48, **overrides})
    if kind == "mixtral":
        mixtral = dict(intermediate_size=32, num_local_experts=num_experts, **routing)
        return MixtralConfig(**{**without_head_dim, **mixtral, **overrides})
    raise ValueError(f"unknown tiny model kind {kind!r}; use one of {list(KINDS)}")


def make_tiny_hf_model(path: str, kind: str = "moe", seed: int = 0, max_shard_size: str = "300KB", **config_kwargs) -> str:
    """Write a tiny HF model (config, sharded safetensors + index, tokenizer) to ``path``; return it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_hf_config(kind, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, max_shard_size=max_shard_size, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path
