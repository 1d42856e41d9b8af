"""The private mbridge internals this package touches, for mbridge 0.15.1 only (``require_version``).

mbridge's public API is ``AutoBridge`` / ``Bridge.load_weights`` / ``save_weights``; the parallel HF export
and the local-spec bridge (``verl/models/mcore``) also use its per-tensor conversions and naming, which are
private methods, and override three of its private hooks (``OVERRIDDEN_HOOKS``, checked by
``check_overridable`` when a bridge class is made). Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from mbridge.core.bridge import _MODEL_REGISTRY, Bridge

from verl.utils.internals import require_version

WRITTEN_FOR = "0.15.1"
require_version("mbridge", WRITTEN_FOR, __name__)

# Hook -> its parameters, as mbridge's model bridges define them. An override of a renamed hook would
# never be called: the model would silently be built or named the mbridge way.
OVERRIDDEN_HOOKS: dict[str, tuple[str, ...]] = {
    "_build_base_config": ("self", "text_config_key", "kwargs"),
    "_get_transformer_layer_spec": ("self", "vp_stage"),
    "_weight_name_mapping_mcore_local_to_global": ("self", "model", "consider_ep"),
}


def bridge_class(model_type: str) -> type[Bridge] | None:
    """mbridge's bridge class for an HF ``model_type`` (its ``_MODEL_REGISTRY``), or None without a mapping;
    ``AutoBridge`` would need a model path, and refusing an unmapped config comes before any model exists."""
    return _MODEL_REGISTRY.get(model_type)


def mlp_mapping_with_dense_layers(bridge_cls: type[Bridge]) -> dict[str, list[str]]:
    """``_MLP_MAPPING`` of ``bridge_cls`` (Megatron name keyword -> HF name templates, first match wins) with
    the dense MLP entries of mbridge's base ``Bridge`` appended where missing: a MoE family's mapping names
    only expert-layer tensors, so a dense layer inside a MoE model (``linear_fc1`` / ``linear_fc2`` and the
    norm fused into ``linear_fc1``) would have no HF name. No entry matches another's tensors."""
    mapping = dict(bridge_cls._MLP_MAPPING)
    for keyword, hf_templates in Bridge._MLP_MAPPING.items():
        mapping.setdefault(keyword, hf_templates)
    return mapping


def check_overridable(bridge_cls: type[Bridge]) -> None:
    """Raise TypeError naming each hook of ``OVERRIDDEN_HOOKS`` that ``bridge_cls`` lacks or defines with
    other parameters."""
    problems = []
    for name, params in OVERRIDDEN_HOOKS.items():
        hook = getattr(bridge_cls, name, None)
        found = tuple(inspect.signature(hook).parameters) if callable(hook) else None
        if found != params:
            problems.append(f"{name}{params} (found: {found or 'missing'})")
    if problems:
        raise TypeError(f"mbridge's {bridge_cls.__name__} changed the hooks verl overrides: " + "; ".join(problems))


def local_to_global_names(bridge: Bridge, model: torch.nn.Module) -> dict[str, str]:
    """``_weight_name_mapping_mcore_local_to_global``: this rank's parameter name -> its global (TE-spec)
    name, layer and expert numbers counted over all PP / EP ranks."""
    return bridge._weight_name_mapping_mcore_local_to_global(model)


def hf_names(bridge: Bridge, global_name: str) -> list[str]:
    """``_weight_name_mapping_mcore_to_hf``: the HF tensors a global Megatron parameter is made of."""
    return bridge._weight_name_mapping_mcore_to_hf(global_name)


def hf_shared_weight_keys(bridge: Bridge) -> list[str]:
    """``_get_hf_shared_weight_keys``: HF tensors an export may leave out (tied weights: the embedding when
    ``tie_word_embeddings``), so their absence is not a missing tensor."""
    return bridge._get_hf_shared_weight_keys()


def merge_across_tp(bridge: Bridge, global_name: str, pieces: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """``_weight_merge_across_tp``: the full parameter from its TP (or expert-TP) pieces, as mbridge merges them."""
    return bridge._weight_merge_across_tp(global_name, pieces, param)


def split_across_tp(
    bridge: Bridge, global_name: str, full: torch.Tensor, param: torch.Tensor, size: int
) -> list[torch.Tensor]:
    """``_weight_split_across_tp``: a full parameter's ``size`` TP (or expert-TP) pieces, as mbridge splits them."""
    return bridge._weight_split_across_tp(global_name, full, param, size)


def to_hf_format(bridge: Bridge, global_name: str, full: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """``_weight_to_hf_format``: a full Megatron parameter as its HF tensors (QKV and gate / up split)."""
    return bridge._weight_to_hf_format(global_name, full)


def to_mcore_format(bridge: Bridge, global_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
    """``_weight_to_mcore_format``: HF tensors as the full Megatron parameter they make."""
    return bridge._weight_to_mcore_format(global_name, hf_weights)


def open_hf_weights(bridge: Bridge, weights_path: str) -> Any:
    """``_get_safetensor_io``: mbridge's reader of the safetensors (and index) at ``weights_path``."""
    return bridge._get_safetensor_io(weights_path)
