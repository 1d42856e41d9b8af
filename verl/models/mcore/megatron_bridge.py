"""Megatron models through NVIDIA's Megatron-Bridge (``megatron.bridge.AutoBridge``), upstream verl's default bridge.

Where TransformerEngine is absent the model is built from megatron-core's local layer spec (Megatron-Bridge's
own ``local_layer_spec``, whose parameter names the bridge maps itself) with every fused kernel off: each
needs TransformerEngine or apex (fused permutation, grouped GEMM, the fused cross entropy, bias / dropout /
softmax / RoPE fusions). Where TransformerEngine is present the provider is left as Megatron-Bridge makes it.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.models.mcore.local_spec import transformer_engine_available
from verl.utils.custom_code import refuse_custom_code
from verl.utils.internals.megatron_bridge import import_megatron_bridge

_FUSIONS_OFF_WITHOUT_TE = {
    "moe_permute_fusion": False,
    "moe_grouped_gemm": False,
    "cross_entropy_loss_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}


def megatron_bridge_provider(hf_path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(AutoBridge, provider)`` for the HF model at ``hf_path``: the provider builds the Megatron model in
    ``dtype`` and loads the HF weights into it (``provide_distributed_model``); finalized."""
    bridge_module = import_megatron_bridge()
    # The package's one rule for a folder it reads: nothing it names runs (verl/utils/custom_code.py).
    refuse_custom_code(hf_path, f"actor_rollout_ref.model.path={hf_path}", "use a folder of a built-in transformers model")
    # By name: Megatron-Bridge 0.6 hands its keyword arguments to the tokenizer too, which then stores a
    # torch.dtype in its config, and the HF save's tokenizer_config.json fails (dtype is not JSON serializable).
    bridge = bridge_module.AutoBridge.from_hf_pretrained(hf_path, dtype=str(dtype).removeprefix("torch."), trust_remote_code=False)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.params_dtype = provider.pipeline_dtype = dtype
    provider.fp16, provider.bf16 = dtype is torch.float16, dtype is torch.bfloat16
    if not transformer_engine_available():
        from megatron.bridge.models.gpt_provider import local_layer_spec

        for field, value in _FUSIONS_OFF_WITHOUT_TE.items():
            setattr(provider, field, value)
        provider.transformer_layer_spec = local_layer_spec
    provider.finalize()
    return bridge, provider
