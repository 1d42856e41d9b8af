"""megatron-core's local (non-TransformerEngine) GPT layer spec, and its names in TE terms.

mbridge only knows the parameter names of the TransformerEngine spec. Where TE is absent (CPU
hosts) the model is built from the local spec, whose few differing names are translated here so
mbridge's load, save and export find every tensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from verl.models.mcore.norm import RMSNorm
from verl.utils.megatron.layer_pattern import megatron_moe_layers

_NORM_FIELDS = ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm")


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _is_norm_class(module: object) -> bool:
    return isinstance(module, type) and module.__name__ in {"WrappedTorchNorm", "FusedLayerNorm", "RMSNorm"}


def _swap_norms(spec: object) -> None:
    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        return
    for field in _NORM_FIELDS:
        if _is_norm_class(getattr(submodules, field, None)):
            setattr(submodules, field, RMSNorm)
    attention = getattr(submodules, "self_attention", None)
    if isinstance(attention, ModuleSpec):
        _swap_norms(attention)


def get_local_decoder_block_spec(config: TransformerConfig, vp_stage: int | None = None):
    """The local GPT block spec with every norm replaced by our sequence-parallel-capable RMSNorm."""
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
    for layer_spec in block_spec.layer_specs:
        _swap_norms(layer_spec)
    block_spec.layer_norm = RMSNorm
    return block_spec


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


_LAYER_NUMBER = re.compile(r"^decoder\.layers\.(\d+)\.")


def local_name_to_te_name(name: str, moe_layers: Sequence[int], expert_offset: int = 0) -> str:
    """Translate one local-spec parameter name to the name the TE spec gives the same tensor.

    ``moe_layers``: per global layer, 1 for a MoE layer and 0 for a dense one (megatron's
    ``moe_layer_freq`` list; all 0 for a dense model): the TE spec fuses a dense layer's pre-MLP norm
    into ``linear_fc1`` but keeps a MoE layer's apart. ``expert_offset`` is this rank's first global
    expert id (EP rank x experts per rank), or 0 for names that stay rank-local.
    """
    if name.endswith(".input_layernorm.weight"):
        return name[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
    if name.endswith(".pre_mlp_layernorm.weight") and not moe_layers[int(_LAYER_NUMBER.match(name).group(1))]:
        return name[: -len("pre_mlp_layernorm.weight")] + "mlp.linear_fc1.layer_norm_weight"
    match = _LOCAL_EXPERT.search(name)
    if match:
        expert_id = int(match.group(1)) + expert_offset
        return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{expert_id}"
    return name


def moe_layer_list(config: TransformerConfig) -> list[int]:
    """megatron's MoE/dense pattern for ``config``, one entry per layer (1: MoE)."""
    return megatron_moe_layers(config.moe_layer_freq, config.num_layers, config.num_moe_experts)
