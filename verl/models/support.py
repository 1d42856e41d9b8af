"""Which HF model families train here, and every config field that would make the bridge build another model.

Torch-free (reads a config object or a plain ``config.json`` dict), so the trainer reports these problems
in its one-second pre-start check together with every other problem of the command line. The rules come
from reading mbridge 0.15.1's mappings against transformers' modelling code, and each is shown by the family
flag matrix (tests/test_family_flag_matrix.py) to prevent a failure; what the bridge maps
wrongly but can be corrected exactly is corrected in ``verl.models.mcore.mbridge`` (router normalisation,
shared-expert gate, missing ``head_dim``) and so is not refused here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The families whose Megatron logits the tests compare with transformers' (tests/test_model_families.py).
SUPPORTED_MODEL_TYPES = ("llama", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The sliding-window fields each family's config has (transformers 5.10), named in the refusal.
_FIELDS_OF = {
    "qwen2": ("use_sliding_window", "max_window_layers", "layer_types"),
    "qwen2_moe": ("use_sliding_window", "max_window_layers", "layer_types"),
    "qwen3": ("use_sliding_window", "max_window_layers", "layer_types"),
    "qwen3_moe": ("use_sliding_window",),
}

# mbridge registers these, but they are not built faithfully here (or not tested): why, per family.
_REFUSED_WHY = {
    "deepseek_v3": (
        "with mbridge 0.15.1 and megatron-core 0.16.1 on the local (non-TransformerEngine) layer spec, mbridge's "
        "config passes max_position_embeddings, which MLATransformerConfig lacks; its MLA attention cannot be built "
        "(the local DotProductAttention takes no separate key/value head dims); grouped routing (n_group, "
        "topk_group) is not mapped; its weight reader refuses fp32 (docs/models.md, DeepSeek-V3, shows each)"
    ),
    "glm4_moe": "its dense first layers and sigmoid routing with expert bias are not built and tested here",
}

# transformers' class defaults for the fields read below, for config.json files that omit them.
_DEFAULTS: dict[str, Any] = {
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "use_sliding_window": False,
    "sliding_window": None,
    "rope_scaling": None,
    "rope_parameters": None,
    "rope_theta": None,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "qkv_bias": True,
    "max_window_layers": 28,
    "layer_types": None,
    "max_position_embeddings": None,
    "mlp_bias": False,
    "shared_expert_intermediate_size": 5632,
}


def _get(hf_config: Any, key: str) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, _DEFAULTS.get(key))
    return getattr(hf_config, key, _DEFAULTS.get(key))


def model_type_of(hf_config: Any) -> str | None:
    """The config's ``model_type`` (object attribute or dict key)."""
    return _get(hf_config, "model_type")


def renormalises_topk(hf_config: Any) -> bool:
    """Whether transformers renormalises a MoE model's top-k router weights to sum to 1.

    Mixtral always does; the Qwen MoE families do exactly when ``norm_topk_prob`` is true (their
    class default is False). mbridge instead fixes it per family (Mixtral and Qwen2-MoE: never; Qwen3-MoE:
    always), so the bridge adapter sets megatron's router from this answer.
    """
    if model_type_of(hf_config) == "mixtral":
        return True
    return bool(_get(hf_config, "norm_topk_prob"))


def rope_scaling(hf_config: Any) -> dict | None:
    """The config's RoPE scaling, or None for plain RoPE.

    transformers 4.57 keeps it in ``rope_scaling`` (None without scaling); transformers 5 keeps
    ``rope_parameters`` (also readable as ``rope_scaling``) with ``rope_theta`` and ``rope_type`` inside,
    ``rope_type='default'`` without scaling.
    """
    scaling = _get(hf_config, "rope_scaling") or _get(hf_config, "rope_parameters")
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return dict(scaling)


def rope_theta(hf_config: Any) -> float:
    """RoPE's base: ``rope_theta`` in transformers 4.57, ``rope_parameters['rope_theta']`` in transformers 5."""
    theta = _get(hf_config, "rope_theta")
    return theta if theta is not None else (_get(hf_config, "rope_parameters") or {})["rope_theta"]


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """Per decoder layer, 1 where transformers builds a routed-expert block and 0 where a dense MLP.

    The Qwen MoE families make layer ``i`` dense when it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
    multiple of ``decoder_sparse_step``; megatron takes the same list as ``moe_layer_freq``.
    """
    num_layers = _get(hf_config, "num_hidden_layers")
    if model_type_of(hf_config) not in ("qwen2_moe", "qwen3_moe"):
        return [1] * num_layers
    dense_only = set(_get(hf_config, "mlp_only_layers") or [])
    step = _get(hf_config, "decoder_sparse_step")
    return [int(i not in dense_only and (i + 1) % step == 0) for i in range(num_layers)]


def sliding_window_layers(hf_config: Any) -> tuple[int | None, list[int]]:
    """(window, layers): the decoder layers on which transformers attends only within ``window`` tokens,
    where the window is shorter than ``max_position_embeddings``; (None, []) when no layer does.

    Mixtral applies ``sliding_window`` to every layer; the Qwen families only with ``use_sliding_window``,
    on the layers ``layer_types`` marks ``sliding_attention`` (a config without it: derived from
    ``max_window_layers`` as transformers' config does, Qwen2-MoE sliding on the even-numbered layers
    below it, Qwen2/Qwen3 on the layers from it on; Qwen3-MoE on every layer).
    """
    model_type = model_type_of(hf_config)
    window = _get(hf_config, "sliding_window")
    if model_type != "mixtral" and not _get(hf_config, "use_sliding_window"):
        window = None
    limit = _get(hf_config, "max_position_embeddings")
    if not window or (limit is not None and window >= limit):
        return None, []
    num_layers = _get(hf_config, "num_hidden_layers") or 0
    layer_types = _get(hf_config, "layer_types")
    if layer_types:
        return window, [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    first = _get(hf_config, "max_window_layers")
    if model_type == "qwen2_moe":
        return window, [i for i in range(num_layers) if (i + 1) % 2 and i < first]
    if model_type in ("qwen2", "qwen3"):
        return window, [i for i in range(num_layers) if i >= first]
    return window, list(range(num_layers))


# The families whose mbridge 0.15.1 bridge names the embedding for the last pipeline stage's copy of a tied
# output layer (Qwen2Bridge and its subclass Qwen3Bridge); the others name it lm_head.weight.
TIED_OUTPUT_MAPPED = ("qwen2", "qwen3")


def hf_layout_problems(hf_config: Any, pipeline_model_parallel_size: int) -> list[str]:
    """The config's problems at a pipeline layout (``hf_config_problems`` holds those of every layout).

    With tied embeddings and more than one pipeline stage the last stage holds a copy of the embedding as its
    output layer; every family but Qwen2/Qwen3 maps that copy to ``lm_head.weight``, which a tied checkpoint
    does not have, so the load fails with a bare KeyError on every last-stage rank.
    """
    model_type = model_type_of(hf_config)
    if pipeline_model_parallel_size > 1 and _get(hf_config, "tie_word_embeddings") and model_type not in TIED_OUTPUT_MAPPED:
        return [
            f"{model_type} config: tie_word_embeddings=True with pipeline_model_parallel_size={pipeline_model_parallel_size}: "
            f"mbridge's {model_type} mapping reads the last stage's copy of the tied embedding from lm_head.weight, which "
            "a tied checkpoint lacks (KeyError at load); set actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1"
        ]
    return []


def hf_config_problems(hf_config: Any) -> list[str]:
    """Every reason the bridge cannot build exactly the model transformers runs for this config; [] if none.

    Each line names the model type, the field, why, and what to change.
    """
    model_type = model_type_of(hf_config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = _REFUSED_WHY.get(model_type, "no model bridge here maps it")
        return [f"model_type={model_type!r} is not supported: {why}; supported model types: {list(SUPPORTED_MODEL_TYPES)}"]
    name = f"{model_type} config"
    problems = []
    if rope_scaling(hf_config):
        problems.append(
            f"{name}: rope_parameters / rope_scaling={rope_scaling(hf_config)}: mbridge reads only its 'factor' as linear "
            "position interpolation, so any other RoPE scaling (llama3, yarn, dynamic) would be computed differently; "
            "use a checkpoint without rope_scaling"
        )
    window, sliding = sliding_window_layers(hf_config)
    if sliding:
        fields = ", ".join(
            f"{key}={_get(hf_config, key)!r}" for key in ("use_sliding_window", "max_window_layers", "layer_types") if key in _FIELDS_OF.get(model_type, ())
        )
        fix = "set sliding_window=null" if model_type == "mixtral" else "set use_sliding_window=false"
        problems.append(
            f"{name}: sliding_window={window} on layers {sliding}" + (f" ({fields})" if fields else "")
            + f": transformers attends only within the window there, the Megatron model over the whole sequence; {fix}"
        )
    if _get(hf_config, "hidden_act") not in ("silu", "swish"):
        problems.append(
            f"{name}: hidden_act={_get(hf_config, 'hidden_act')!r}: mbridge builds every family's MLP with SiLU, so the "
            "Megatron model would compute another function than transformers; use a checkpoint with hidden_act='silu'"
        )
    if model_type == "qwen2_moe" and not _get(hf_config, "qkv_bias"):
        problems.append(
            f"{name}: qkv_bias=False: mbridge's Qwen2-MoE always builds QKV biases, and loading a checkpoint without "
            "them fails (KeyError on q_proj.bias); use a checkpoint with qkv_bias=true"
        )
    if model_type in ("llama", "qwen3", "qwen3_moe") and _get(hf_config, "attention_bias"):
        problems.append(
            f"{name}: attention_bias=True: mbridge gives this family's attention no output-projection bias "
            "(and Qwen3 no QKV bias), so those weights would be dropped; use a checkpoint with attention_bias=false"
        )
    if model_type == "llama" and _get(hf_config, "mlp_bias"):
        problems.append(f"{name}: mlp_bias=True: mbridge builds the MLP without biases and would drop them; use a checkpoint with mlp_bias=false")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = _get(hf_config, "decoder_sparse_step")
        if not isinstance(step, int) or step < 1:
            problems.append(f"{name}: decoder_sparse_step={step!r}: must be a positive integer (transformers divides by it)")
        elif _get(hf_config, "num_hidden_layers") and not any(moe_layer_pattern(hf_config)):
            dense = "qwen2" if model_type == "qwen2_moe" else "qwen3"
            problems.append(
                f"{name}: mlp_only_layers={_get(hf_config, 'mlp_only_layers')}, decoder_sparse_step={step} leave no "
                f"MoE layer, which megatron cannot build as a MoE model; use model_type {dense} for a dense model"
            )
    if model_type == "qwen2_moe" and not _get(hf_config, "shared_expert_intermediate_size"):
        problems.append(
            f"{name}: shared_expert_intermediate_size={_get(hf_config, 'shared_expert_intermediate_size')}: "
            "transformers still builds a (zero-width) shared expert and its gate, which the Megatron model has no "
            "tensors for, so the HF export would be incomplete; use a checkpoint with a shared expert"
        )
    return problems
