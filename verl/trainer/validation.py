"""Every check of a trainer config that can run before any rank starts.

Each problem is one line that names the override fixing it. ``check_config`` reads only the config and
the model's ``config.json`` (no torch, no Ray), so a bad command line fails in about a second;
``check_device`` and ``check_model_build`` need torch / megatron and run only once the cheap checks pass.
"""

from __future__ import annotations

import os
import re
from typing import Any

from omegaconf import OmegaConf

from verl.models.support import hf_config_problems, hf_layout_problems
from verl.trainer.config import AlgoConfig, DataConfig, TrainerConfig
from verl.trainer.config.keys import ACTOR as _ACTOR
from verl.trainer.config.keys import CHECKPOINT as _CHECKPOINT
from verl.trainer.config.keys import MEGATRON as _MEGATRON
from verl.trainer.config.keys import REF as _REF
from verl.trainer.run_config import typed_node
from verl.trainer.upstream_keys import check_upstream_keys
from verl.utils.checkpoint.layout import checkpoint_root_problem, resume_step_problem
from verl.utils.custom_code import oversized_file_problem, read_json
from verl.utils.internals.megatron_bridge import megatron_bridge_install_problem
from verl.utils.megatron.parallel import ParallelConfigError, ParallelSizes, num_routed_experts
from verl.workers.config import build_megatron_actor_configs, megatron_param_dtype, megatron_worker_config_problems

# verl.trainer.ppo.core_algos.kl_penalty_types() (not imported: it pulls in torch): upstream's estimator names
# and their straight-through "+" forms; upstream's "full" is not implemented (upstream raises for it too).
KL_LOSS_TYPES = tuple(f"{name}{plus}" for plus in ("", "+") for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"))


def world_size(config: Any) -> int:
    return int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)


def parallel_sizes(config: Any) -> ParallelSizes:
    return ParallelSizes.from_megatron(config.actor_rollout_ref.actor.megatron)


def read_model_config(model_path: str) -> dict:
    return read_json(os.path.join(model_path, "config.json"))


def pre_start_problems(config: Any, cluster: bool, model_path: str | None = None) -> tuple[str | None, str | None, list[str]]:
    """The model path (``actor_rollout_ref.model.path`` made absolute; None: the embedded model), the device of a
    local run (None on a cluster, or when not known yet) and every problem the cheap checks find, before any
    model or rank is built. ``model_path``: check this model instead of the configured one."""
    if model_path is None:
        given = OmegaConf.select(config, "actor_rollout_ref.model.path")
        model_path = os.path.abspath(os.path.expanduser(str(given))) if given else None
    problems, device = check_config(config, model_path), None
    if not problems or OmegaConf.select(config, "trainer.device") in ("cuda", "npu"):
        device, device_problems = check_device(config, cluster)
        problems += device_problems + check_async_mode(config, device)
    return model_path, device, problems


def check_config(config: Any, model_path: str | None) -> list[str]:
    """Problems found in the config alone, plus the model's layout from its config.json when ``model_path``
    is given (None: the embedded model, which is checked once it is made)."""
    trainer, problems = typed_node(TrainerConfig, config.trainer)
    data, data_problems = typed_node(DataConfig, config.data)
    algorithm, algorithm_problems = typed_node(AlgoConfig, config.algorithm)
    problems += data_problems + algorithm_problems + _check_untyped_keys(config)
    if algorithm is not None:
        problems += algorithm.validate()
    typed = not problems
    if trainer is not None:
        problems += _check_trainer(trainer, data)
    problems += _guarded(typed, _check_actor, config)
    problems += _check_typed_configs(config, problems)
    model = None
    if model_path is not None:
        model, model_problems = _read_model(model_path)
        problems += model_problems
        if model is not None:
            pp = OmegaConf.select(config, f"{_MEGATRON}pipeline_model_parallel_size")
            support = hf_config_problems(model) + (hf_layout_problems(model, pp) if isinstance(pp, int) else [])
            problems += [f"actor_rollout_ref.model.path={model_path}: {p}" for p in support]
    problems += _guarded(typed, _check_layout, config, model)
    problems += _guarded(typed, _check_grpo, config)
    if data is not None:
        problems += _guarded(typed, _check_data, config, data, model)
    problems += _guarded(typed, check_upstream_keys, config)
    return problems


# The keys no typed config holds (the reference's log-prob pass, Ray's):
# a mistyped value is one line here, not a TypeError further down.
_UNTYPED_KEYS = (
    ("actor_rollout_ref.nccl_timeout", "a number", "<x>", lambda v: _is_number(v)),
    ("ray_kwargs.ray_init.num_cpus", "an integer or null", "<n>", lambda v: v is None or _is_int(v)),
    (f"{_REF}.log_prob_micro_batch_size_per_gpu", "an integer or null", "<n>", lambda v: v is None or _is_int(v)),
    (f"{_REF}.log_prob_max_token_len_per_gpu", "an integer or null", "<n>", lambda v: v is None or _is_int(v)),
    (f"{_REF}.log_prob_use_dynamic_bsz", "true or false", "<true|false>", lambda v: isinstance(v, bool)),
)  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_untyped_keys(config: Any) -> list[str]:
    problems = []
    for key, kind, example, accepts in _UNTYPED_KEYS:
        value = OmegaConf.select(config, key)
        if not accepts(value):
            problems.append(f"{key}={value} must be {kind}; set {key}={example}")
    return problems


def _guarded(typed: bool, check: Any, *args: Any) -> list[str]:
    """Run one group of checks; once a mistyped key is reported, a check that trips over it adds nothing."""
    try:
        return check(*args)
    except (TypeError, ValueError):
        if typed:
            raise
        return []


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_trainer(trainer: TrainerConfig, data: DataConfig | None) -> list[str]:
    """What the trainer node's fields cannot say alone: this host, the data, the checkpoint root on disk."""
    problems = trainer.validate(data_has_val_files=bool(data is None or data.val_files))
    problems.append(checkpoint_root_problem(str(trainer.default_local_dir), "trainer.default_local_dir"))
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        problems.append(resume_step_problem(str(trainer.resume_from_path), "trainer.resume_from_path"))
    return [problem for problem in problems if problem]


def _check_typed_configs(config: Any, reported: list[str]) -> list[str]:
    """The typed configs the worker builds check themselves (dtype, optim, checkpoint, the bools, ...): built
    here too, so a value they refuse is one line before the run starts, not a traceback from a rank. A key
    an earlier check named (a mistyped one, say) is not reported twice, nor a reference key whose actor key is
    named (the reference's megatron values follow the actor's in the YAML: one problem, one line)."""
    def key(problem: str) -> str:  # each line starts with the key it names
        return re.match(r"[^\s=:]*", problem).group()

    named = {key(problem) for problem in reported}
    found = megatron_worker_config_problems(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
    kept = [problem for problem in found if key(problem) not in named]
    named |= {key(problem) for problem in kept}

    def follows_the_actor(name: str) -> bool:  # a reference value the YAML takes from the actor's, whose key is named
        actor = name.replace(".ref.megatron.", ".actor.megatron.", 1)
        if actor == name or actor not in named:
            return False
        parent, _, leaf = name.rpartition(".")
        return OmegaConf.is_interpolation(OmegaConf.select(config, parent), leaf)

    return [problem for problem in kept if not follows_the_actor(key(problem))]


def _check_actor(config: Any) -> list[str]:
    actor = config.actor_rollout_ref.actor
    megatron, checkpoint = actor.megatron, actor.checkpoint
    problems = []
    if actor.strategy != "megatron":
        problems.append(f"actor_rollout_ref.actor.strategy={actor.strategy}: only megatron is implemented; set actor_rollout_ref.actor.strategy=megatron")
    if not _positive_int(actor.ppo_micro_batch_size_per_gpu):
        problems.append(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu} must be an integer >= 1")
    if not megatron.use_mbridge:
        problems.append(f"{_MEGATRON}use_mbridge=False: models are built only through a bridge here (mbridge or Megatron-Bridge, chosen by {_MEGATRON}vanilla_mbridge); set {_MEGATRON}use_mbridge=True")
    missing_bridge = megatron_bridge_install_problem(bool(megatron.vanilla_mbridge))
    if missing_bridge is not None:
        problems.append(missing_bridge)
    if megatron.grad_offload and not megatron.param_offload:
        problems.append(f"{_MEGATRON}grad_offload=True without param_offload: grads are offloaded together with the weights; set {_MEGATRON}param_offload=True or grad_offload=False")
    if int(megatron.context_parallel_size) > 1:
        problems.append(f"{_MEGATRON}context_parallel_size={megatron.context_parallel_size}: the update step does not split sequences over context-parallel ranks yet; set {_MEGATRON}context_parallel_size=1")
    if int(megatron.tensor_model_parallel_size) > 1 and not megatron.sequence_parallel:
        problems.append(f"{_MEGATRON}sequence_parallel=False with tensor_model_parallel_size={megatron.tensor_model_parallel_size}: both bridges build with sequence parallelism when TP > 1 (MoE requires it); set {_MEGATRON}sequence_parallel=True")
    if _positive_int(config.trainer.save_freq) and not list(checkpoint.save_contents):
        problems.append(f"{_CHECKPOINT}save_contents is empty but trainer.save_freq={config.trainer.save_freq}; list what to save or set trainer.save_freq=-1")
    return problems


def _read_model(model_path: str) -> tuple[dict | None, list[str]]:
    if not os.path.isdir(model_path):
        return None, [f"actor_rollout_ref.model.path={model_path} does not exist; set actor_rollout_ref.model.path to a local HF model directory (or null for the embedded tiny model)"]
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return None, [f"actor_rollout_ref.model.path={model_path} has no config.json; it is not an HF model directory"]
    oversized = oversized_file_problem(os.path.join(model_path, "config.json"))
    if oversized:
        return None, [f"actor_rollout_ref.model.path={model_path}: {oversized}; point it at an HF model directory"]
    try:
        return read_model_config(model_path), []
    except OSError as exc:
        return None, [f"actor_rollout_ref.model.path={model_path}: config.json is unreadable ({exc})"]
    except ValueError as exc:
        return None, [f"actor_rollout_ref.model.path={model_path}: {exc}; point it at an HF model directory"]


def _check_layout(config: Any, model: dict | None) -> list[str]:
    try:
        sizes = parallel_sizes(config)
    except (TypeError, ValueError) as exc:
        return [f"{_MEGATRON}*_parallel_size must be integers: {exc}"]
    if not _positive_int(config.trainer.nnodes) or not _positive_int(config.trainer.n_gpus_per_node):
        return []  # the world size is unknown; reported above
    numbers = {}
    if model is not None:
        numbers = {
            "num_layers": model.get("num_hidden_layers"),
            "num_experts": num_routed_experts(model),
            "num_attention_heads": model.get("num_attention_heads"),
            "num_key_value_heads": model.get("num_key_value_heads"),
        }
    try:
        sizes.validate(world_size(config), **numbers)
    except ParallelConfigError as exc:
        return exc.problems
    return []


def _check_data(config: Any, data: DataConfig, model: dict | None) -> list[str]:
    """The data's files, and what the data node must agree on with the rollout, the model and the batch split."""
    problems = data.validate(custom_reward=bool(config.custom_reward_function.path))
    rollout = config.actor_rollout_ref.rollout
    for ours, theirs in (("max_prompt_length", "prompt_length"), ("max_response_length", "response_length")):
        if rollout[theirs] != data[ours]:
            problems.append(f"actor_rollout_ref.rollout.{theirs}={rollout[theirs]} differs from data.{ours}={data[ours]}: the rollout and the actor read one length here; set both to one value (or leave rollout.{theirs} at its default, ${{data.{ours}}})")
    if problems:
        return problems
    seq = data.max_prompt_length + data.max_response_length
    if model is not None and seq > int(model.get("max_position_embeddings", seq)):
        problems.append(f"data.max_prompt_length + data.max_response_length = {seq} exceeds the model's max_position_embeddings={model['max_position_embeddings']}; lower them")
    return problems + _check_batch_split(config) + _check_token_budgets(config)


def _check_token_budgets(config: Any) -> list[str]:
    """Dynamic batch sizes need room for one whole sequence, as upstream requires."""
    actor, rollout, data = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, config.data
    longest = int(data.max_prompt_length) + int(data.max_response_length)
    problems = []
    for flag, budget, name in (
        (actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, f"{_ACTOR}.ppo_max_token_len_per_gpu"),
        (rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        *_ref_pass(config, lambda ref: (ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu, f"{_REF}.log_prob_max_token_len_per_gpu")),
    ):
        if flag and (budget is None or int(budget) < longest):
            problems.append(f"{name}={budget} is below one sequence (data.max_prompt_length + max_response_length = {longest}); raise it to {longest} or more")
    return problems


def _check_batch_split(config: Any) -> list[str]:
    """Prompts x n must split into data-parallel ranks, mini-batches and whole microbatches."""
    actor, n = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout.n
    train, mini, micro = int(config.data.train_batch_size), actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu
    if not (_positive_int(mini) and _positive_int(micro) and _positive_int(n)):
        return []  # reported by _check_grpo / _check_actor
    if train % mini:
        return [f"data.train_batch_size={train} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size={mini}; set ppo_mini_batch_size to a divisor of it"]
    megatron = config.actor_rollout_ref.actor.megatron
    tp, pp, cp = (int(megatron[k]) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    if not (_positive_int(config.trainer.nnodes) and _positive_int(config.trainer.n_gpus_per_node)) or min(tp, pp, cp) < 1:
        return []
    world = world_size(config)
    if world % (tp * pp * cp):
        return []  # reported by _check_layout
    dp = world // (tp * pp * cp)
    sequences = mini * n
    if sequences % dp:
        return [f"a mini-batch of actor_rollout_ref.actor.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {sequences} sequences does not split into {dp} data-parallel ranks; make it a multiple of {dp}"]
    if (sequences // dp) % micro and not actor.use_dynamic_bsz:
        return [f"{sequences // dp} sequences per data-parallel rank and mini-batch (ppo_mini_batch_size={mini} x rollout.n={n} / {dp} ranks) do not split into microbatches of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}; set it to a divisor of {sequences // dp}"]
    interleaved = _interleaved_split_problem(megatron, sequences // dp, micro, actor.use_dynamic_bsz)
    if interleaved:
        return [interleaved]
    rollout = config.actor_rollout_ref.rollout
    rows = train * n // dp if (train * n) % dp == 0 else None
    if rows is None:
        return [f"data.train_batch_size={train} x rollout.n={n} sequences do not split into {dp} data-parallel ranks; make it a multiple of {dp}"]
    for node, name in ((rollout, "actor_rollout_ref.rollout"), *_ref_pass(config, lambda ref: (ref, _REF))):
        log_micro = node.log_prob_micro_batch_size_per_gpu
        if log_micro is not None and not node.log_prob_use_dynamic_bsz and (not _positive_int(log_micro) or rows % log_micro):
            return [f"{name}.log_prob_micro_batch_size_per_gpu={log_micro} does not divide the {rows} sequences of a step on each data-parallel rank; set it to a divisor of {rows}"]
    return []


def _interleaved_split_problem(megatron: Any, rows: int, micro: int, dynamic: bool) -> str | None:
    """The interleaved schedule runs a mini-batch's microbatches in groups of PP per model chunk: their number
    must be a multiple of PP (the log-prob passes top theirs up; an update cannot without changing the loss)."""
    vpp, pp = megatron.virtual_pipeline_model_parallel_size, int(megatron.pipeline_model_parallel_size)
    if vpp is None or vpp <= 1 or pp < 2:
        return None
    if dynamic and rows % pp:
        return f"{rows} sequences per data-parallel rank and mini-batch cannot make a multiple of pipeline_model_parallel_size={pp} microbatches, which {_MEGATRON}virtual_pipeline_model_parallel_size={vpp} needs; make {_ACTOR}.ppo_mini_batch_size x rollout.n / data-parallel size a multiple of {pp}"
    if not dynamic and (rows // micro) % pp:
        return f"{rows // micro} microbatches per data-parallel rank and mini-batch ({rows} sequences / {_ACTOR}.ppo_micro_batch_size_per_gpu={micro}) is not a multiple of pipeline_model_parallel_size={pp}, which {_MEGATRON}virtual_pipeline_model_parallel_size={vpp} needs; set ppo_micro_batch_size_per_gpu so that {rows} / it is a multiple of {pp}"
    return None


def _ref_pass(config: Any, entry: Any) -> list:
    """``[entry(ref node)]`` when the run builds a reference model (its log-prob pass is checked like the rollout's), else []."""
    return [entry(config.actor_rollout_ref.ref)] if config.actor_rollout_ref.actor.use_kl_loss else []


def _check_grpo(config: Any) -> list[str]:
    rollout, actor = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    problems = []
    if actor.use_kl_loss:
        problems += _check_kl_loss(config)
    if actor.loss_agg_mode != "token-mean":
        problems.append(f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode}: only token-mean is implemented; set actor_rollout_ref.actor.loss_agg_mode=token-mean")
    if rollout.name != "hf":
        problems.append(f"actor_rollout_ref.rollout.name={rollout.name}: only the in-process transformers rollout (hf) is available here; set actor_rollout_ref.rollout.name=hf")
    if not _positive_int(rollout.n) or rollout.n < 2:
        problems.append(f"actor_rollout_ref.rollout.n={rollout.n}: GRPO compares responses within a group; set actor_rollout_ref.rollout.n to 2 or more")
    if not float(rollout.temperature) > 0:
        problems.append(f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0")
    if not 0 < float(rollout.top_p) <= 1:
        problems.append(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    if not (0 < float(low) < 1 and float(high) > 0):
        problems.append(f"actor_rollout_ref.actor.clip_ratio (low {low}, high {high}) must be > 0 (low < 1)")
    if not float(actor.clip_ratio_c) > 1:
        problems.append(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1")
    return problems


def _check_kl_loss(config: Any) -> list[str]:
    """The KL loss's settings, and the reference model's: built on the actor's ranks, in the actor's layout,
    from the HF model the actor starts from."""
    actor, ref = config.actor_rollout_ref.actor, config.actor_rollout_ref.ref
    problems = []
    if actor.kl_loss_type not in KL_LOSS_TYPES:
        problems.append(f"{_ACTOR}.kl_loss_type={actor.kl_loss_type} is not implemented here (one of {list(KL_LOSS_TYPES[:7])}, or one of them with '+'); set {_ACTOR}.kl_loss_type=low_var_kl")
    megatron = actor.megatron
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size"):
        theirs, ours = ref.megatron[key], megatron[key]
        if key == "expert_tensor_parallel_size":  # null: the tensor-parallel size (both null: the TP check says it)
            if theirs is None and ours is None:
                continue
            theirs = ref.megatron.tensor_model_parallel_size if theirs is None else theirs
            ours = megatron.tensor_model_parallel_size if ours is None else ours
        if theirs != ours:
            problems.append(f"{_REF}.megatron.{key}={ref.megatron[key]} differs from the actor's ({megatron[key]}): the reference runs on the actor's ranks in the actor's layout here; set it to {megatron[key]} (its default follows the actor)")
    if not _same_dtype(ref.megatron.dtype, megatron.dtype):
        problems.append(f"{_REF}.megatron.dtype={ref.megatron.dtype} differs from the actor's ({megatron.dtype}): the reference runs in the actor's dtype here; set it to {megatron.dtype} (its default follows the actor)")
    if ref.megatron.use_dist_checkpointing:
        problems.append(f"{_REF}.megatron.use_dist_checkpointing=True: the reference is built from the HF actor_rollout_ref.model.path only; set it to False")
    if ref.log_prob_micro_batch_size is not None:
        problems.append(f"{_REF}.log_prob_micro_batch_size={ref.log_prob_micro_batch_size}: upstream's deprecated global form; set {_REF}.log_prob_micro_batch_size_per_gpu instead")
    return problems


def _same_dtype(one: Any, other: Any) -> bool:
    """Whether two ``megatron.dtype`` values name one dtype (``bf16`` is ``bfloat16``)."""
    try:
        return megatron_param_dtype(one) == megatron_param_dtype(other)
    except ValueError:
        return one == other


def check_device(config: Any, cluster: bool) -> tuple[str | None, list[str]]:
    """The device type the ranks compute on, for a local run (``cluster=False``), with its problems.

    On a Ray cluster the device is decided from the cluster's resources instead (``check_cluster``).
    """
    requested = config.trainer.device
    if cluster:
        return (None if requested == "auto" else requested), []
    if _is_int(config.trainer.nnodes) and config.trainer.nnodes > 1:
        return None, [f"trainer.nnodes={config.trainer.nnodes} needs a Ray cluster: set RAY_ADDRESS (or submit with `ray job submit`), or set trainer.nnodes=1"]
    if requested == "cpu":
        return "cpu", []
    if requested == "npu":
        return None, ["trainer.device=npu: the Ray worker group places ranks on GPUs or CPUs only; set trainer.device=cpu (or cuda on a GPU host)"]
    from verl.utils.device import get_device_name, get_torch_device

    found = get_device_name()
    device = found if requested == "auto" else requested
    if device == "npu":
        return None, ["this host's accelerator is an NPU: the Ray worker group places ranks on GPUs or CPUs only; set trainer.device=cpu"]
    if requested != "auto" and found != requested:
        return None, [f"trainer.device={requested} but this host has no {requested} device; set trainer.device=cpu (or auto)"]
    if device != "cpu":
        count = get_torch_device().device_count()
        if _is_int(config.trainer.n_gpus_per_node) and config.trainer.n_gpus_per_node > count:
            return None, [f"trainer.n_gpus_per_node={config.trainer.n_gpus_per_node} but this host has {count} {device} device(s); set trainer.n_gpus_per_node={count}"]
    return device, []


def check_async_mode(config: Any, device: str | None) -> list[str]:
    """``checkpoint.async_mode`` on the device the run computes on (None: not known yet); the typed config's own
    check, which each rank's checkpoint manager repeats. A config that does not build was reported already."""
    if device is None:
        return []
    try:
        checkpoint = build_megatron_actor_configs({"checkpoint": config.actor_rollout_ref.actor.get("checkpoint")}, path=_ACTOR).checkpoint
    except ValueError:
        return []
    try:
        checkpoint.validate(device, key=f"{_CHECKPOINT}async_mode")
    except ValueError as exc:
        return [str(exc)]
    return []


def check_cluster(config: Any, requested: str | None, resources: dict, alive_nodes: int) -> tuple[str, list[str]]:
    """Device and capacity of the Ray cluster the run joined."""
    gpus = int(resources.get("GPU", 0))
    device = requested or ("cuda" if gpus else "cpu")
    problems = []
    if alive_nodes < int(config.trainer.nnodes):
        problems.append(f"trainer.nnodes={config.trainer.nnodes} but the Ray cluster has {alive_nodes} node(s); set trainer.nnodes={alive_nodes}")
    if device == "cuda" and gpus < world_size(config):
        problems.append(f"{world_size(config)} ranks need as many GPUs but the Ray cluster has {gpus}; set trainer.n_gpus_per_node / trainer.nnodes (or trainer.device=cpu)")
    return device, problems


def check_model_build(model_path: str, config: Any) -> list[str]:
    """The full pre-start check of the model (mbridge support, exact representability, layout), all problems at once."""
    from verl.models.mcore import UnsupportedHFConfigError, validate_model_build
    from verl.utils.custom_code import CustomCodeError

    try:
        hf_config = validate_model_build(model_path, parallel_sizes(config), world_size(config))
    except UnsupportedHFConfigError as exc:
        return [f"actor_rollout_ref.model.path={model_path}: {p}" for p in exc.problems]
    except ParallelConfigError as exc:
        return exc.problems
    except (FileNotFoundError, CustomCodeError) as exc:
        return [str(exc)]
    vanilla_mbridge = bool(config.actor_rollout_ref.actor.megatron.vanilla_mbridge)
    if not vanilla_mbridge and megatron_bridge_install_problem(vanilla_mbridge) is None:  # else _check_actor says so
        from verl.models.mcore.bridge import megatron_bridge_family_problem

        family = megatron_bridge_family_problem(hf_config)
        if family is not None:
            return [f"actor_rollout_ref.model.path={model_path}: {family}"]
    return _check_mbridge_config(model_path, config)


def _check_mbridge_config(model_path: str, config: Any) -> list[str]:
    """``checkpoint.mbridge_config``: every entry must be an argument of the HF save of the bridge this model gets."""
    from verl.models.mcore.mbridge import bridge_class_for
    from verl.utils.checkpoint.mbridge_config import save_weights_kwargs

    node = OmegaConf.select(config, f"{_CHECKPOINT}mbridge_config")
    if not node:
        return []
    entries = OmegaConf.to_container(node, resolve=True)
    if config.actor_rollout_ref.actor.megatron.vanilla_mbridge:
        save_weights, save_name = bridge_class_for(read_model_config(model_path)["model_type"]).save_weights, "mbridge's save_weights"
    else:
        from verl.models.mcore.megatron_bridge import MegatronBridgeWeights

        save_weights, save_name = MegatronBridgeWeights.save_weights, "Megatron-Bridge's save_hf_weights"
    try:
        strict = OmegaConf.select(config, f"{_CHECKPOINT}strict", default=True)
        save_weights_kwargs(save_weights, entries, key=f"{_CHECKPOINT}mbridge_config", save_name=save_name, strict=strict)
    except ValueError as exc:
        return [str(exc)]
    return []
