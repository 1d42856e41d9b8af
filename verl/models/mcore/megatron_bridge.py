"""Megatron models through NVIDIA's Megatron-Bridge (``megatron.bridge.AutoBridge``), upstream verl's default bridge.

Where TransformerEngine is absent the model is built from the project's local block spec (megatron-core's
local layers, the MoE/dense pattern per layer and the sequence-parallel RMSNorm: the same modules, so the same
dist-checkpoint names, as the mbridge path builds; Megatron-Bridge maps the local names itself) with every fused
kernel off: each needs TransformerEngine or apex (fused permutation, grouped GEMM, the fused cross entropy,
bias / dropout / softmax / RoPE fusions). Where TransformerEngine is present the provider is left as
Megatron-Bridge makes it (its TE spec). ``MegatronBridgeWeights`` puts Megatron-Bridge's own HF weight save
behind the checkpoint manager's HF export; ``MegatronBridgeModel`` is the whole bridge surface the engine uses
(``verl.models.mcore.bridge``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl.models.mcore.local_spec import get_local_decoder_block_spec, transformer_engine_available
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


def megatron_bridge_provider(
    hf_path: str, dtype: torch.dtype = torch.float32, sizes: ParallelSizes | None = None, load_weights: bool = True
) -> tuple[Any, Any]:
    """``(AutoBridge, provider)`` for the HF model at ``hf_path``: the provider builds the Megatron model in
    ``dtype`` at the parallel layout ``sizes`` (default: one rank) and, with ``load_weights``, loads the HF
    weights into it (``provide_distributed_model``); finalized. No MTP (multi-token prediction) head, whatever
    the config counts: the actor trains none, as upstream's default (``actor_rollout_ref.model.mtp.enable=False``)."""
    bridge_module = import_megatron_bridge()
    # The package's one rule for a folder it reads: nothing it names runs (verl/utils/custom_code.py).
    refuse_custom_code(hf_path, f"actor_rollout_ref.model.path={hf_path}", "use a folder of a built-in transformers model")
    # By name: Megatron-Bridge 0.6 hands its keyword arguments to the tokenizer too, which then stores a
    # torch.dtype in its config, and the HF save's tokenizer_config.json fails (dtype is not JSON serializable).
    bridge = bridge_module.AutoBridge.from_hf_pretrained(hf_path, dtype=str(dtype).removeprefix("torch."), trust_remote_code=False)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.params_dtype = provider.pipeline_dtype = dtype
    provider.fp16, provider.bf16 = dtype is torch.float16, dtype is torch.bfloat16
    provider.mtp_num_layers = None
    sizes = sizes or ParallelSizes()
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = sizes.tp, sizes.pp
    provider.expert_model_parallel_size, provider.expert_tensor_parallel_size = sizes.ep, sizes.expert_tp
    provider.context_parallel_size = sizes.cp
    provider.virtual_pipeline_model_parallel_size = sizes.virtual_stages  # model chunks per pipeline rank
    provider.sequence_parallel = sizes.tp > 1  # as mbridge builds it (MoE with TP needs it)
    if not transformer_engine_available():
        for field, value in _FUSIONS_OFF_WITHOUT_TE.items():
            setattr(provider, field, value)
        provider.use_cpu_initialization = True  # as mbridge's local-spec build initialises
        provider.transformer_layer_spec = _local_block_spec
    provider.finalize()
    return bridge, provider


def _local_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    return get_local_decoder_block_spec(config, vp_stage=vp_stage)


def _to_current_device(chunks: list) -> list:
    """Each chunk moved to the current device before the DDP wrap (whose buffers are allocated there), as
    mbridge's ``get_model`` moves them."""
    return [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]


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


class MegatronBridgeModel(MegatronBridgeWeights):
    """The bridge surface the engine builds through (``verl.models.mcore.bridge``), over Megatron-Bridge: ``config``
    (the provider, a TransformerConfig), ``get_model`` with mbridge's keywords, ``load_weights`` from an HF
    folder, the HF save, and ``gather_hf_weights`` for the rollout's weight sync. Needs megatron parallel state;
    the layout is read from it."""

    def __init__(self, hf_path: str, dtype: torch.dtype = torch.float32) -> None:
        from verl.utils.checkpoint.megatron_state_dicts import current_parallel_layout

        layout = current_parallel_layout()  # this process's sizes, as a save's manifest records them
        sizes = ParallelSizes(**{key: value for key, value in layout.items() if key != "world_size"})
        auto_bridge, self.config = megatron_bridge_provider(hf_path, dtype, sizes, load_weights=False)
        super().__init__(auto_bridge)
        self.dtype = dtype

    def get_model(
        self,
        wrap_with_ddp: bool = True,
        bf16: bool = False,
        fp16: bool = False,
        use_cpu_initialization: bool = True,
        ddp_config: dict | None = None,
        data_parallel_random_init: bool = False,
    ) -> list:
        """The model chunks on the current device, randomly initialised (``load_weights`` fills them), DDP-wrapped
        with ``ddp_config``'s fields (``DistributedDataParallelConfig``) when ``wrap_with_ddp``.

        ``use_cpu_initialization`` has mbridge's meaning: accepted and unused, the provider's own field says where
        parameters are initialised, and the chunks always end on the device. Megatron-Bridge's own meaning (write
        the field, then leave the model on the CPU when it is True) would keep a GPU host's model on its CPU."""
        from megatron.core.distributed import DistributedDataParallelConfig

        hooks = [hook for hook in (self.config.pre_wrap_hook, _to_current_device) if hook is not None]
        return self.config.provide_distributed_model(
            ddp_config=DistributedDataParallelConfig(**ddp_config) if wrap_with_ddp else None,
            wrap_with_ddp=wrap_with_ddp,
            bf16=bf16,
            fp16=fp16,
            use_cpu_initialization=self.config.use_cpu_initialization,
            data_parallel_random_init=data_parallel_random_init,
            pre_wrap_hook=hooks,
        )

    def load_weights(self, models: list, weights_path: str) -> None:
        """The HF folder's weights into the model (every rank; each reads the tensors it holds)."""
        refuse_custom_code(weights_path, f"HF weights {weights_path}", "use a folder of a built-in transformers model")
        self.auto_bridge.load_hf_weights(models, weights_path)

    def gather_hf_weights(self, models: list, receivers: list[int]) -> dict[str, torch.Tensor]:
        """Every HF tensor of the model, whole, on each rank in ``receivers`` (an empty dict on the others); every
        rank takes part (Megatron-Bridge's export gathers each tensor to all ranks)."""
        keep = torch.distributed.get_rank() in receivers
        weights = {}
        with hf_save_without_modelopt():
            for name, tensor in self.auto_bridge.export_hf_weights(models, cpu=True, show_progress=False):
                if keep:
                    weights[name] = tensor
        return weights
