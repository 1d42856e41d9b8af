"""Build an mbridge ``Bridge`` for an HF config, refusing configs it cannot represent faithfully.

Where TransformerEngine is importable the bridge is mbridge's own class, which builds the TE spec. Where
it is not (CPU hosts) the bridge builds the model from megatron-core's local spec and speaks TE names to
mbridge through ``local_spec.local_name_to_te_name``. Both save HF weights with the parallel export, so
the same load/save/export code runs on both (tests/test_te_spec_names.py runs it on the TE spec).
"""

from __future__ import annotations

import copy
import os
import weakref

import torch
from mbridge.core.bridge import Bridge
from mbridge.core.safetensor_io import SafeTensorIO
from mbridge.core.util import unwrap_model
from transformers import PretrainedConfig

from verl.models.mcore.local_spec import (
    get_local_decoder_block_spec,
    local_name_to_te_name,
    moe_layer_list,
    transformer_engine_available,
)
from verl.models.mcore.parallel_hf_save import gather_hf_weights, is_expert_te_name, save_weights_in_parallel
from verl.models.support import (
    MOE_MODEL_TYPES,
    hf_config_problems,
    hf_layout_problems,
    moe_layer_pattern,
    renormalises_topk,
    rope_scaling,
    rope_theta,
)
from verl.utils.custom_code import load_config
from verl.utils.internals import mbridge as mbridge_internals
from verl.utils.rank_comm import RankComm


class UnsupportedHFConfigError(ValueError):
    """The HF config describes a model the bridge would silently build differently; ``problems``: one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def load_hf_config(hf_path: str, where: str | None = None) -> PretrainedConfig:
    """The HF config at a local model directory, with a clear error when the path is not one; a folder naming
    custom code is refused (``verl.utils.custom_code``; ``where``: the key or argument that gave the folder)."""
    if not os.path.isdir(hf_path):
        raise FileNotFoundError(
            f"HF model path {hf_path!r} does not exist; set actor_rollout_ref.model.path to a local HF model directory"
        )
    if not os.path.isfile(os.path.join(hf_path, "config.json")):
        raise FileNotFoundError(f"HF model path {hf_path!r} has no config.json; it is not an HF model directory")
    return load_config(hf_path, where or f"actor_rollout_ref.model.path={hf_path}")


def check_hf_config_supported(hf_config: PretrainedConfig, pipeline_model_parallel_size: int = 1) -> None:
    """Refuse HF configs whose model the bridge cannot represent exactly (at that pipeline layout), naming every
    problem at once."""
    problems = hf_config_problems(hf_config) + hf_layout_problems(hf_config, pipeline_model_parallel_size)
    if not problems and mbridge_internals.bridge_class(hf_config.model_type) is None:
        problems = [f"model_type={hf_config.model_type!r} has no mbridge mapping in this mbridge install"]
    if problems:
        raise UnsupportedHFConfigError(problems)


def _bridge_view_of(hf_config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``hf_config`` with what mbridge 0.15.1 reads spelled as it reads it.

    - ``head_dim``: transformers' MixtralConfig (like real Mixtral checkpoints) leaves it None; mbridge then
      multiplies None in its QKV conversion. transformers itself uses hidden_size / num_attention_heads.
    - ``rope_theta`` and ``rope_scaling``: transformers 5 keeps both in ``rope_parameters``
      (``{'rope_theta': ..., 'rope_type': 'default'}`` for plain RoPE), where mbridge finds no
      ``rope_theta`` and takes the dict for a scaling it reads ``factor`` from; plain RoPE (the only kind
      ``verl.models.support`` lets through) is ``rope_theta`` with ``rope_scaling=None`` to mbridge.
    The caller's config stays as given, so the exported config.json is the user's.
    """
    view = copy.deepcopy(hf_config)
    if getattr(view, "head_dim", None) is None:
        view.head_dim = view.hidden_size // view.num_attention_heads
    if getattr(view, "rope_theta", None) is None:
        view.rope_theta = rope_theta(hf_config)
    if rope_scaling(hf_config) is None and getattr(view, "rope_scaling", None) is not None:
        view.rope_scaling = None
    return view


class _FaithfulConfigMixin:
    """Corrects, exactly, what mbridge 0.15.1 maps differently from transformers (on every host).

    - Router normalisation: mbridge fixes ``moe_router_pre_softmax`` per family (Mixtral and Qwen2-MoE:
      softmax over all experts then top-k, not renormalised; Qwen3-MoE: top-k then softmax, i.e.
      renormalised), while transformers renormalises for Mixtral always and for the Qwen families when
      ``norm_topk_prob``. Softmax is monotone, so top-k of the logits then softmax over the k equals
      softmax, top-k, renormalise; pre-softmax equals no renormalisation.
    - Qwen2-MoE's shared expert is scaled by ``sigmoid(shared_expert_gate(x))`` in transformers; mbridge
      maps the gate's weight but never asks megatron to build it (``moe_shared_expert_gate``).
    - Dense layers inside a Qwen MoE model (``mlp_only_layers``, ``decoder_sparse_step``): mbridge builds
      every layer as MoE; megatron's ``moe_layer_freq`` takes transformers' per-layer pattern, and the
      dense layers' weights are named by mbridge's dense MLP mapping (``_bridge_class``).
    """

    def _build_base_config(self, text_config_key=None, **kwargs):
        hf_config = self.hf_config
        if hf_config.model_type in MOE_MODEL_TYPES:
            kwargs["moe_router_pre_softmax"] = not renormalises_topk(hf_config)
            pattern = moe_layer_pattern(hf_config)
            if not all(pattern):
                kwargs["moe_layer_freq"] = pattern
        if hf_config.model_type == "qwen2_moe" and getattr(hf_config, "shared_expert_intermediate_size", 0):
            kwargs["moe_shared_expert_gate"] = True
        return super()._build_base_config(text_config_key, **kwargs)


class _LocalSpecBridgeMixin:
    """Mixed in front of an mbridge model class to build and name the local-spec model. Overrides mbridge's
    private hooks (``verl.utils.internals.mbridge.OVERRIDDEN_HOOKS``, checked when the class is made)."""

    def _build_base_config(self, text_config_key=None, **kwargs):
        # Grouped GEMM needs TE or the grouped_gemm kernels; the local spec runs one MLP per expert.
        kwargs.update(moe_grouped_gemm=False, use_cpu_initialization=True, persist_layer_norm=False)
        return super()._build_base_config(text_config_key, **kwargs)

    def _get_transformer_layer_spec(self, vp_stage: int | None = None):
        self.has_vp_stage = True
        return get_local_decoder_block_spec(self.config, vp_stage=vp_stage)

    def _weight_name_mapping_mcore_local_to_global(self, model: torch.nn.Module, consider_ep: bool = True) -> dict[str, str]:
        """mbridge's names, each translated to the TE spec's. A constant of the built chunk (its parameters, the
        layer pattern, this rank's expert-parallel place), so it is computed when the chunk is first named (its
        load, as the engine is built); every save and export after that reads the same names (a copy)."""
        chunk = unwrap_model(model)
        named = self.__dict__.setdefault("_te_names", weakref.WeakKeyDictionary()).setdefault(chunk, {})
        if consider_ep not in named:
            mapping = super()._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=consider_ep)
            moe_layers = moe_layer_list(self.config)
            offset = 0
            if self.config.num_moe_experts and consider_ep and self.mpu.ep_size > 1:
                offset = self.mpu.ep_rank * (self.config.num_moe_experts // self.mpu.ep_size)
            named[consider_ep] = {local: local_name_to_te_name(name, moe_layers, offset) for local, name in mapping.items()}
        return dict(named[consider_ep])

    def load_weights(self, models: list, weights_path: str, memory_efficient: bool = False) -> None:
        """Load HF weights; rank 0 of each TP (or expert-TP) group reads, then scatters the shards."""
        self.safetensor_io = mbridge_internals.open_hf_weights(self, weights_path)
        for model in models:
            state = unwrap_model(model).state_dict()
            names = {
                local: te_name
                for local, te_name in mbridge_internals.local_to_global_names(self, model).items()
                if "_extra_state" not in local
            }
            hf_names = {local: mbridge_internals.hf_names(self, te) for local, te in names.items()}
            to_read = [n for local, te in names.items() if self._shard_group(te)[1] == 0 for n in hf_names[local]]
            hf_weights = self.safetensor_io.load_some_hf_weight(to_read) if to_read else {}
            for local, te_name in names.items():
                self._load_one(state[local], te_name, hf_names[local], hf_weights)

    def _shard_group(self, te_name: str):
        if is_expert_te_name(te_name):
            return self.mpu.etp_group, self.mpu.etp_rank, self.mpu.etp_size
        return self.mpu.tp_group, self.mpu.tp_rank, self.mpu.tp_size

    def _load_one(self, param: torch.Tensor, te_name: str, hf_names: list[str], hf_weights: dict) -> None:
        group, group_rank, group_size = self._shard_group(te_name)
        shards = None
        if group_rank == 0:
            full = mbridge_internals.to_mcore_format(self, te_name, [hf_weights[n] for n in hf_names])
            shards = [s.to(param.dtype).contiguous() for s in mbridge_internals.split_across_tp(self, te_name, full, param, group_size)]
            if shards[0].shape != param.shape:
                raise ValueError(
                    f"HF tensor(s) {hf_names} give shape {tuple(shards[0].shape)} per rank, but Megatron "
                    f"parameter {te_name} has shape {tuple(param.shape)}: the HF config and weights disagree."
                )
        if group_size == 1:
            param.copy_(shards[0])
            return
        received = torch.empty_like(param)
        src = torch.distributed.get_global_rank(group, 0)
        torch.distributed.scatter(received, shards, src=src, group=group)
        param.copy_(received)


class _ParallelSaveMixin:
    """The HF weight save with every rank writing the files it owns (``parallel_hf_save``), for the
    local-spec bridge and mbridge's own TE-spec one alike: the export names every tensor through mbridge's
    mapping of the model's own parameters, so the TE spec's names (``linear_qkv.layer_norm_weight``, grouped
    experts' ``linear_fc1.weight{i}``; ``_extra_state`` is no parameter) need nothing of their own."""

    def save_weights(self, models: list, weights_path: str, memory_efficient: bool = False, comm: RankComm | None = None) -> list[str] | None:
        """Write the HF folder with every rank writing the files it owns (``parallel_hf_save``).

        The files and the tensors in them are the same as mbridge's ``save_weights`` writes (bit for
        bit when the model was loaded from an HF folder with an index; without one, the same tensors
        in about one file per rank plus an index instead of a single file). ``config.json`` already
        in ``weights_path`` (the checkpoint manager writes it first) is left as it is. An
        ``export_weights`` replaced on the instance is honoured by taking mbridge's own path.
        ``comm``: the group of ranks that writes (default: torch.distributed's default group; the
        background save passes its forked processes' group); only the parallel path takes one. Returns the
        files this rank wrote (the checkpoint's per-writer durability: ``verl.utils.checkpoint.durability``);
        None from mbridge's own save, where rank 0 writes every file.
        """
        if not self.saves_in_parallel:
            if comm is not None:
                raise ValueError("only the parallel HF save runs over another group than the default one")
            self.save_weights_gathered(models, weights_path, memory_efficient=memory_efficient)
            return None
        return save_weights_in_parallel(self, models, weights_path, comm)

    def gather_hf_weights(self, models: list, receivers: list[int]) -> dict[str, torch.Tensor]:
        """Every HF tensor of the model, whole, on each rank in ``receivers`` (``parallel_hf_save.gather_hf_weights``)."""
        return gather_hf_weights(self, models, receivers)

    @property
    def saves_in_parallel(self) -> bool:
        """Whether ``save_weights`` takes the parallel path (and so can run over any group)."""
        return "export_weights" not in vars(self) and torch.distributed.is_initialized()

    def save_weights_gathered(self, models: list, weights_path: str, memory_efficient: bool = False) -> None:
        """mbridge's own save: every tensor gathered to rank 0, which writes every file."""
        if self.safetensor_io is None:
            # No source index (the model was not loaded from HF here): write a single safetensors file.
            self.safetensor_io = SafeTensorIO(weights_path)
        super().save_weights(models, weights_path, memory_efficient=memory_efficient)


_CLASSES: dict[tuple[type, bool], type] = {}


def _bridge_class(bridge_cls: type, use_local_spec: bool) -> type:
    key = (bridge_cls, use_local_spec)
    if key not in _CLASSES:
        mbridge_internals.check_overridable(bridge_cls)
        spec = (_LocalSpecBridgeMixin,) if use_local_spec else ()
        bases = (*spec, _ParallelSaveMixin, _FaithfulConfigMixin, bridge_cls)
        prefix = "LocalSpec" if use_local_spec else "Faithful"
        namespace = {"_MLP_MAPPING": mbridge_internals.mlp_mapping_with_dense_layers(bridge_cls)}
        _CLASSES[key] = type(f"{prefix}{bridge_cls.__name__}", bases, namespace)
    return _CLASSES[key]


def make_bridge(
    hf_config: PretrainedConfig,
    dtype: torch.dtype = torch.bfloat16,
    use_local_spec: bool | None = None,
    refuse_unsupported: bool = True,
) -> Bridge:
    """The mbridge bridge for ``hf_config``; needs megatron parallel state to be initialised.

    ``use_local_spec`` defaults to True exactly when TransformerEngine is not importable. The bridge
    gets a copy of the config with a missing ``head_dim`` filled in; ``hf_config`` is not changed.
    ``refuse_unsupported=False`` builds even a config ``verl.models.support`` refuses (the tests that show
    what each refusal prevents).
    """
    if refuse_unsupported:
        check_hf_config_supported(hf_config)
    return bridge_class_for(hf_config.model_type, use_local_spec)(_bridge_view_of(hf_config), dtype=dtype)


def bridge_class_for(model_type: str, use_local_spec: bool | None = None) -> type:
    """The bridge class ``make_bridge`` builds for an HF ``model_type`` (readable before any parallel state)."""
    if use_local_spec is None:
        use_local_spec = not transformer_engine_available()
    return _bridge_class(mbridge_internals.bridge_class(model_type), use_local_spec)
