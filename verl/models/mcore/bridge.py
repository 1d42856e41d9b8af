"""The one place that chooses the HF <-> Megatron bridge (upstream's ``actor.megatron.vanilla_mbridge``).

``vanilla_mbridge=True``: the mbridge package (``verl.models.mcore.mbridge``); False: NVIDIA's Megatron-Bridge
(``verl.models.mcore.megatron_bridge``), upstream verl's default. Either answer has the same surface, and
nothing outside this module asks which one it is: ``config`` (the TransformerConfig), ``dtype``, ``get_model``
(mbridge's keywords; ``verl.models.mcore.model.build_megatron_model`` wraps it), ``load_weights(models, path)``,
``save_weights(models, path, **checkpoint.mbridge_config)`` with ``saves_in_parallel`` (the checkpoint manager's
HF export, after fix 2's config-first barrier) and ``gather_hf_weights(models, receivers)`` (the rollout's sync).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PretrainedConfig

from verl.models.mcore.local_spec import transformer_engine_available
from verl.models.mcore.mbridge import UnsupportedHFConfigError, check_hf_config_supported, make_bridge
from verl.models.support import hf_config_problems
from verl.utils.checkpoint.integrity import BridgeRecord
from verl.utils.internals.megatron_bridge import (
    VANILLA_MBRIDGE_KEY,
    import_megatron_bridge,
    megatron_bridge_install_problem,
)

# The families the Megatron-Bridge path is proven for here (parity with transformers, the dist checkpoint and the
# HF export bit for bit: tests/py312). Others it maps may build a different model, or none (Mixtral, Qwen2-MoE).
MEGATRON_BRIDGE_MODEL_TYPES = ("qwen3_moe",)


def megatron_bridge_family_problem(hf_config: PretrainedConfig) -> str | None:
    """The one-line refusal of a model the Megatron-Bridge path is not proven for here, or that the installed
    Megatron-Bridge has no bridge for; None when it builds. Needs Megatron-Bridge installed."""
    model_type = getattr(hf_config, "model_type", None)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if model_type not in MEGATRON_BRIDGE_MODEL_TYPES:
        why = f"is not proven through Megatron-Bridge here (proven: {', '.join(MEGATRON_BRIDGE_MODEL_TYPES)})"
    elif not set(architectures) & set(import_megatron_bridge().AutoBridge.list_supported_models()):
        why = f"(architectures={architectures}) has no bridge in the installed Megatron-Bridge"
    else:
        return None
    return f"model_type={model_type!r} {why}: set {VANILLA_MBRIDGE_KEY}=True to build it through mbridge"


def make_model_bridge(
    model_path: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype = torch.float32,
    vanilla_mbridge: bool = False,
    refuse_unsupported: bool = True,
) -> Any:
    """The bridge of the HF model at ``model_path`` (``hf_config``: its config, already loaded); needs megatron
    parallel state. ``refuse_unsupported=False`` builds even a config ``verl.models.support`` refuses."""
    if vanilla_mbridge:
        return make_bridge(hf_config, dtype=dtype, refuse_unsupported=refuse_unsupported)
    problem = megatron_bridge_install_problem(vanilla_mbridge)
    if problem is not None:
        raise RuntimeError(problem)
    if refuse_unsupported:
        problems = hf_config_problems(hf_config)
        family = megatron_bridge_family_problem(hf_config)
        if problems or family is not None:
            raise UnsupportedHFConfigError(problems or [family])
    from verl.models.mcore.megatron_bridge import MegatronBridgeModel

    return MegatronBridgeModel(model_path, dtype=dtype)


def bridge_name(bridge: Any) -> str:
    """Which bridge ``make_model_bridge`` built, as a run reports it: ``Megatron-Bridge`` or ``mbridge``."""
    from verl.models.mcore.megatron_bridge import MegatronBridgeModel

    return "Megatron-Bridge" if isinstance(bridge, MegatronBridgeModel) else "mbridge"


def checkpoint_bridge(vanilla_mbridge: bool) -> BridgeRecord:
    """The bridge ``make_model_bridge`` builds through for ``vanilla_mbridge`` and the layer spec it builds from
    here (each bridge builds megatron-core's local spec exactly where TransformerEngine is absent), as a step's
    manifest records it and a resume compares it (``verl.utils.checkpoint.resume_check``)."""
    return BridgeRecord(
        name="mbridge" if vanilla_mbridge else "Megatron-Bridge",
        layer_spec="transformer_engine" if transformer_engine_available() else "local",
    )


def transformer_config_without_ranks(hf_config: PretrainedConfig, vanilla_mbridge: bool = False) -> Any:
    """The TransformerConfig the bridge gives ``hf_config``, made without parallel state or process groups (the
    pre-start identity check of a resumed step; its fields do not depend on the layout); None when this
    bridge cannot map the family here (the ranks then check after they start)."""
    if vanilla_mbridge:
        # mbridge's own mapping, given explicit single-rank parallel states; head_dim left unset (Mixtral) is
        # filled with transformers' own default, hidden_size / num_attention_heads, as the ranks' bridge does.
        from mbridge import AutoBridge
        from mbridge.core.parallel_states import ParallelStates

        view = copy.deepcopy(hf_config)
        if getattr(view, "head_dim", None) is None and getattr(view, "num_attention_heads", None):
            view.head_dim = view.hidden_size // view.num_attention_heads
        try:
            return AutoBridge.from_config(view, dtype=torch.float32, parallel_states=ParallelStates()).config
        except Exception:  # noqa: BLE001 - a family mbridge maps only on ranks: leave the check to them
            return None
    try:
        return import_megatron_bridge().AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
    except Exception:  # noqa: BLE001 - as above
        return None


__all__ = [
    "UnsupportedHFConfigError",
    "bridge_name",
    "check_hf_config_supported",
    "checkpoint_bridge",
    "make_model_bridge",
    "megatron_bridge_family_problem",
    "transformer_config_without_ranks",
]
