"""The private mbridge internals this package touches, each checked where first used (``Internal``).

mbridge's public API is ``AutoBridge`` / ``Bridge.load_weights`` / ``save_weights``; the parallel HF export
and the local-spec bridge (``verl/models/mcore``) also use its per-tensor conversions and naming, which are
private methods, and override three of its private hooks (``OVERRIDDEN_HOOKS``, checked by
``check_overridable`` when a bridge class is made). A method is checked on the bridge's own class, so an
override is what is checked. None has a public replacement: a missing or changed one raises
``InternalsChangedError`` in the feature that needs it. Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from verl.utils.internals import CONTRACT_TEST, Internal, InternalsChangedError, warn_if_untested

if TYPE_CHECKING:
    from mbridge.core.bridge import Bridge

warn_if_untested("mbridge")

_BRIDGE = "mbridge.core.bridge:Bridge"
_LOCAL_SPEC = "the local-spec bridge (verl/models/mcore/mbridge.py)"
_EXPORT = "the parallel HF export and the local-spec bridge's load"

MODEL_REGISTRY = Internal("mbridge", "mbridge.core.bridge:_MODEL_REGISTRY", "making a bridge for an HF config")
MLP_MAPPING = Internal("mbridge", f"{_BRIDGE}._MLP_MAPPING", _LOCAL_SPEC)
# Hooks verl overrides, with their parameters as mbridge's model bridges define them. An override of a
# renamed hook would never be called: the model would silently be built or named the mbridge way.
OVERRIDDEN_HOOKS = tuple(
    Internal("mbridge", f"mbridge.core.llm_bridge:LLMBridge.{name}", _LOCAL_SPEC, params=params)
    for name, params in (
        ("_build_base_config", ("self", "text_config_key", "kwargs")),
        ("_get_transformer_layer_spec", ("self", "vp_stage")),
        ("_weight_name_mapping_mcore_local_to_global", ("self", "model", "consider_ep")),
    )
)
_METHODS = {  # the methods verl calls: their parameters
    "_weight_name_mapping_mcore_local_to_global": ("self", "model", "consider_ep"),
    "_weight_name_mapping_mcore_to_hf": ("self", "mcore_weights_name"),
    "_get_hf_shared_weight_keys": ("self",),
    "_weight_merge_across_tp": ("self", "mcore_weights_name", "mcore_weights", "param"),
    "_weight_split_across_tp": ("self", "mcore_weights_name", "mcore_weights", "param", "tp_split_size"),
    "_weight_to_hf_format": ("self", "mcore_weights_name", "mcore_weights"),
    "_weight_to_mcore_format": ("self", "mcore_weights_name", "hf_weights"),
    "_get_safetensor_io": ("self", "weights_path"),
}
METHODS = {name: Internal("mbridge", f"{_BRIDGE}.{name}", _EXPORT, params=params) for name, params in _METHODS.items()}
INTERNALS = (MODEL_REGISTRY, MLP_MAPPING, *OVERRIDDEN_HOOKS, *METHODS.values())


def _call(name: str, bridge: Bridge, *args: Any) -> Any:
    """``bridge.<name>(*args)``, its method checked on the bridge's class first."""
    METHODS[name].get(type(bridge))
    return getattr(bridge, name)(*args)


class _NoModelType:
    """Stands for ``ModelType.encoder_and_decoder`` where megatron-core no longer has it: equal to no model type."""

    def __repr__(self) -> str:
        return "ModelType.encoder_and_decoder (removed from megatron-core; no model has it)"


def let_get_model_compare_model_types() -> None:
    """Make mbridge's ``Bridge.get_model`` run on a megatron-core without ``ModelType.encoder_and_decoder``.

    mbridge 0.15.1's ``get_model`` compares the model type with ``ModelType.encoder_and_decoder`` on every
    build; megatron-core 0.18 removed that name with its encoder-decoder models (upstream verl #6936), so the
    build fails with AttributeError. Up to 0.17 the class attribute exists but equals no member (a deprecated
    property), which is the answer mbridge's GPT models always got. Where the name is missing it is given a
    value equal to no model type; where it exists nothing changes (a capability check, not a version check).
    """
    from megatron.core.transformer.enums import ModelType  # the class mbridge reads (through gpt_model)

    if not hasattr(ModelType, "encoder_and_decoder"):
        ModelType.encoder_and_decoder = _NoModelType()


def bridge_class(model_type: str) -> type[Bridge] | None:
    """mbridge's bridge class for an HF ``model_type`` (its ``_MODEL_REGISTRY``), or None without a mapping;
    ``AutoBridge`` would need a model path, and refusing an unmapped config comes before any model exists."""
    return MODEL_REGISTRY.get().get(model_type)


def mlp_mapping_with_dense_layers(bridge_cls: type[Bridge]) -> dict[str, list[str]]:
    """``_MLP_MAPPING`` of ``bridge_cls`` (Megatron name keyword -> HF name templates, first match wins) with
    the dense MLP entries of mbridge's base ``Bridge`` appended where missing: a MoE family's mapping names
    only expert-layer tensors, so a dense layer inside a MoE model (``linear_fc1`` / ``linear_fc2`` and the
    norm fused into ``linear_fc1``) would have no HF name. No entry matches another's tensors."""
    mapping = dict(MLP_MAPPING.get(bridge_cls))
    for keyword, hf_templates in MLP_MAPPING.get().items():
        mapping.setdefault(keyword, hf_templates)
    return mapping


def check_overridable(bridge_cls: type[Bridge]) -> None:
    """Raise ``InternalsChangedError`` naming each hook of ``OVERRIDDEN_HOOKS`` that ``bridge_cls`` lacks or
    defines with other parameters."""
    problems = []
    for hook in OVERRIDDEN_HOOKS:
        try:
            hook.get(bridge_cls)
        except InternalsChangedError as exc:
            problems.append(str(exc).split(";")[0])
    if problems:
        raise InternalsChangedError(
            f"mbridge's {bridge_cls.__name__} changed the hooks verl overrides: "
            + "; ".join(problems)
            + f". Run {CONTRACT_TEST} against this release and adapt verl/utils/internals."
        )


def local_to_global_names(bridge: Bridge, model: torch.nn.Module) -> dict[str, str]:
    """``_weight_name_mapping_mcore_local_to_global``: this rank's parameter name -> its global (TE-spec)
    name, layer and expert numbers counted over all PP / EP ranks."""
    return _call("_weight_name_mapping_mcore_local_to_global", bridge, model)


def hf_names(bridge: Bridge, global_name: str) -> list[str]:
    """``_weight_name_mapping_mcore_to_hf``: the HF tensors a global Megatron parameter is made of."""
    return _call("_weight_name_mapping_mcore_to_hf", bridge, global_name)


def hf_shared_weight_keys(bridge: Bridge) -> list[str]:
    """``_get_hf_shared_weight_keys``: HF tensors an export may leave out (tied weights: the embedding when
    ``tie_word_embeddings``), so their absence is not a missing tensor."""
    return _call("_get_hf_shared_weight_keys", bridge)


def merge_across_tp(bridge: Bridge, global_name: str, pieces: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """``_weight_merge_across_tp``: the full parameter from its TP (or expert-TP) pieces, as mbridge merges them."""
    return _call("_weight_merge_across_tp", bridge, global_name, pieces, param)


def split_across_tp(
    bridge: Bridge, global_name: str, full: torch.Tensor, param: torch.Tensor, size: int
) -> list[torch.Tensor]:
    """``_weight_split_across_tp``: a full parameter's ``size`` TP (or expert-TP) pieces, as mbridge splits them."""
    return _call("_weight_split_across_tp", bridge, global_name, full, param, size)


def to_hf_format(bridge: Bridge, global_name: str, full: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """``_weight_to_hf_format``: a full Megatron parameter as its HF tensors (QKV and gate / up split)."""
    return _call("_weight_to_hf_format", bridge, global_name, full)


def to_mcore_format(bridge: Bridge, global_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
    """``_weight_to_mcore_format``: HF tensors as the full Megatron parameter they make."""
    return _call("_weight_to_mcore_format", bridge, global_name, hf_weights)


def open_hf_weights(bridge: Bridge, weights_path: str) -> Any:
    """``_get_safetensor_io``: mbridge's reader of the safetensors (and index) at ``weights_path``."""
    return _call("_get_safetensor_io", bridge, weights_path)
