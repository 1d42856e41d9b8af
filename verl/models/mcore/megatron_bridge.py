"""Megatron models through NVIDIA's Megatron-Bridge (``megatron.bridge.AutoBridge``), upstream verl's default bridge.

Where TransformerEngine is absent the model is built from megatron-core's local layer spec (Megatron-Bridge's
own ``local_layer_spec``, whose parameter names the bridge maps itself) with every fused kernel off: each
needs TransformerEngine or apex (fused permutation, grouped GEMM, the fused cross entropy, bias / dropout /
softmax / RoPE fusions). Where TransformerEngine is present the provider is left as Megatron-Bridge makes it.
``MegatronBridgeWeights`` puts Megatron-Bridge's own HF weight save behind the checkpoint manager's HF export.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.models.mcore.local_spec import transformer_engine_available
from verl.utils.custom_code import refuse_custom_code
from verl.utils.internals.megatron_bridge import hf_save_without_modelopt, import_megatron_bridge
from verl.utils.megatron.parallel import ParallelSizes

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


def megatron_bridge_provider(hf_path: str, dtype: torch.dtype = torch.float32, sizes: ParallelSizes | None = None) -> tuple[Any, Any]:
    """``(AutoBridge, provider)`` for the HF model at ``hf_path``: the provider builds the Megatron model in
    ``dtype`` at the parallel layout ``sizes`` (default: one rank) and loads the HF weights into it
    (``provide_distributed_model``); finalized. No MTP (multi-token prediction) head, whatever the config
    counts: the actor trains none, as upstream's default (``actor_rollout_ref.model.mtp.enable=False``)."""
    bridge_module = import_megatron_bridge()
    # The package's one rule for a folder it reads: nothing it names runs (verl/utils/custom_code.py).
    refuse_custom_code(hf_path, f"actor_rollout_ref.model.path={hf_path}", "use a folder of a built-in transformers model")
    # By name: Megatron-Bridge 0.6 hands its keyword arguments to the tokenizer too, which then stores a
    # torch.dtype in its config, and the HF save's tokenizer_config.json fails (dtype is not JSON serializable).
    bridge = bridge_module.AutoBridge.from_hf_pretrained(hf_path, dtype=str(dtype).removeprefix("torch."), trust_remote_code=False)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.params_dtype = provider.pipeline_dtype = dtype
    provider.fp16, provider.bf16 = dtype is torch.float16, dtype is torch.bfloat16
    provider.mtp_num_layers = None
    sizes = sizes or ParallelSizes()
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = sizes.tp, sizes.pp
    provider.expert_model_parallel_size, provider.expert_tensor_parallel_size = sizes.ep, sizes.expert_tp
    provider.context_parallel_size = sizes.cp
    if not transformer_engine_available():
        from megatron.bridge.models.gpt_provider import local_layer_spec

        for field, value in _FUSIONS_OFF_WITHOUT_TE.items():
            setattr(provider, field, value)
        provider.transformer_layer_spec = local_layer_spec
    provider.finalize()
    return bridge, provider


class MegatronBridgeWeights:
    """Megatron-Bridge's HF weight save (``AutoBridge.save_hf_weights``) as the checkpoint manager's HF export
    calls a bridge: ``save_weights(models, weights_path, **checkpoint.mbridge_config)`` on every rank, after
    rank 0 wrote the folder's config and a barrier (fix 2, upstream #6821).

    The order matters to Megatron-Bridge: its save reads ``config.json`` from the output folder to learn
    whether the model has MTP layers, and on 0.5 that file is its only source for a model built without the
    MTP head its checkpoint has; the shard holding both the MTP tensors and the last layer's then never
    completes and is left out (docs/checkpoint.md, "Fix 2 under Megatron-Bridge"). It gathers over the
    default group (rank 0 writes every file), so it never runs in a save's forked processes.
    """

    saves_in_parallel = False

    def __init__(self, auto_bridge: Any) -> None:
        self.auto_bridge = auto_bridge

    def save_weights(self, models: list, weights_path: str, strict: bool = True) -> None:
        """Every rank: the model's tensors under their HF names, in the source checkpoint's shards with its index.
        ``strict`` (upstream's ``checkpoint.strict``): a tensor the source checkpoint does not name, or a
        shard left incomplete, is an error rather than a warning."""
        with hf_save_without_modelopt():
            self.auto_bridge.save_hf_weights(models, weights_path, show_progress=False, strict=strict)
