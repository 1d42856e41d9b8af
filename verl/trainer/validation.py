"""Every check of a trainer config that can run before any rank starts.

Each problem is one line that names the override fixing it. ``check_config`` reads only the config and
the model's ``config.json`` (no torch, no Ray), so a bad command line fails in about a second;
``check_device`` and ``check_model_build`` need torch / megatron and run only once the cheap checks pass.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf

from verl.models.support import hf_config_problems, hf_layout_problems
from verl.trainer.config import AlgoConfig, DataConfig, TrainerConfig
from verl.trainer.config.field_checks import is_int, is_number
from verl.trainer.config.keys import ACTOR as _ACTOR
from verl.trainer.config.keys import CHECKPOINT as _CHECKPOINT
from verl.trainer.config.keys import REF as _REF
from verl.trainer.config.rollout_choice import configured_model_path
from verl.trainer.run_config import trainer_config_or_none, typed_node
from verl.trainer.upstream_keys import check_upstream_keys
from verl.utils.internals.megatron_bridge import megatron_bridge_install_problem
from verl.utils.megatron.parallel import ParallelConfigError, ParallelSizes
from verl.workers.config import build_megatron_actor_configs, checked_worker_config, read_hf_config


def pre_start_problems(config: Any, cluster: bool, model_path: str | None = None) -> tuple[str | None, str | None, list[str]]:
    """The model path (``actor_rollout_ref.model.path`` made absolute; None: the embedded model), the device of a
    local run (None on a cluster, or when not known yet) and every problem the cheap checks find, before any
    model or rank is built. ``model_path``: check this model instead of the configured one."""
    if model_path is None:
        model_path = configured_model_path(config)
    problems, device = check_config(config, model_path), None
    if not problems or OmegaConf.select(config, "trainer.device") in ("cuda", "npu"):
        device, device_problems = check_device(trainer_config_or_none(config), cluster)
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
    worker, worker_problems = checked_worker_config(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
    problems += _not_named_yet(config, worker_problems, problems)
    typed = not problems
    if trainer is not None:
        problems += trainer.validate(data_has_val_files=bool(data is None or data.val_files))
    if algorithm is not None:
        problems += algorithm.validate()
    model = None
    if model_path is not None:
        model, model_problems = read_hf_config(model_path)
        problems += model_problems
        pp = OmegaConf.select(config, f"{_ACTOR}.megatron.pipeline_model_parallel_size")
        if model is not None:
            support = hf_config_problems(model) + (hf_layout_problems(model, pp) if isinstance(pp, int) else [])
            problems += [f"actor_rollout_ref.model.path={model_path}: {p}" for p in support]
    world = trainer.world_size if trainer is not None else None
    if worker is not None:
        actor, rollout = worker["actor"], worker["rollout"]
        problems += actor.unsupported(rollout.n) + rollout.unsupported() + (worker["ref"].validate(actor) if actor.use_kl_loss else [])
        problems += rollout.model_problems(model) if model is not None else []
        problems += [problem for problem in (megatron_bridge_install_problem(actor.megatron.vanilla_mbridge),) if problem]
        if trainer is not None and trainer.save_freq > 0 and not actor.checkpoint.save_contents:
            problems.append(f"{_CHECKPOINT}save_contents is empty but trainer.save_freq={trainer.save_freq}; list what to save or set trainer.save_freq=-1")
        try:
            if world is not None:
                ParallelSizes.from_megatron(actor.megatron).validate_for_hf_config(world, model)
        except ParallelConfigError as exc:
            problems += exc.problems
    if data is not None:
        problems += _check_data(data, bool(OmegaConf.select(config, "custom_reward_function.path")), worker, world, model)
    return [_keyed(problem) for problem in problems] + _guarded(typed, check_upstream_keys, config)


# A typed config's own name in a message -> the Hydra key of the node it was built from.
_NODE_KEYS = {"McoreActorConfig.": f"{_ACTOR}.", "RefConfig.": f"{_REF}.", "RolloutConfig.": "actor_rollout_ref.rollout.", "HFModelConfig.": "actor_rollout_ref.model."}


def _keyed(message: str) -> str:
    for owner, key in _NODE_KEYS.items():
        message = message.replace(owner, key)
    return message


def _check_untyped_keys(config: Any) -> list[str]:
    """The keys no typed config holds: a mistyped value is one line here, not a TypeError further down."""
    problems = []
    for key, kind, example, accepts in (
        ("actor_rollout_ref.nccl_timeout", "a number >= 0 (seconds)", "<x>", lambda v: is_number(v) and v >= 0),
        ("ray_kwargs.ray_init.num_cpus", "an integer or null", "<n>", lambda v: v is None or is_int(v)),
    ):
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


def _not_named_yet(config: Any, found: list[str], reported: list[str]) -> list[str]:
    """The worker's typed configs' refusals, less a key an earlier check named and a reference key whose actor
    key is named (the reference's megatron values follow the actor's in the YAML: one problem, one line)."""
    def key(problem: str) -> str:  # each line starts with the key it names
        return re.match(r"[^\s=:]*", problem).group()

    named = {key(problem) for problem in reported}
    kept = [problem for problem in found if key(problem) not in named]
    named |= {key(problem) for problem in kept}

    def follows_the_actor(name: str) -> bool:  # a reference value the YAML takes from the actor's, whose key is named
        actor = name.replace(".ref.megatron.", ".actor.megatron.", 1)
        parent, _, leaf = name.rpartition(".")
        return actor != name and actor in named and OmegaConf.is_interpolation(OmegaConf.select(config, parent), leaf)

    return [problem for problem in kept if not follows_the_actor(key(problem))]


def _check_data(data: DataConfig, custom_reward: bool, worker: dict | None, world: int | None, model: dict | None) -> list[str]:
    """The data's files (``custom_reward``: the user's reward function scores any data source), and what the data
    node must agree on with the rollout, the model and the batch split (``worker``: its typed nodes, when built):
    a step's prompts x n split into mini-batches, data-parallel ranks and whole micro batches (the actor's rule),
    the log-prob passes' micro batches divide a rank's share of the step, and token budgets hold a sequence."""
    problems = data.validate(custom_reward=custom_reward)
    if worker is None:
        return problems
    actor, rollout = worker["actor"], worker["rollout"]
    for ours, theirs in (("max_prompt_length", "prompt_length"), ("max_response_length", "response_length")):
        if rollout[theirs] != data[ours]:
            problems.append(f"actor_rollout_ref.rollout.{theirs}={rollout[theirs]} differs from data.{ours}={data[ours]}: the rollout and the actor read one length here; set both to one value (or leave rollout.{theirs} at its default, ${{data.{ours}}})")
    if problems:
        return problems
    seq = data.max_prompt_length + data.max_response_length
    if model is not None and seq > int(model.get("max_position_embeddings", seq)):
        problems.append(f"data.max_prompt_length + data.max_response_length = {seq} exceeds the model's max_position_embeddings={model['max_position_embeddings']}; lower them")
    rows = None  # a step's sequences on a data-parallel rank, once the actor's split holds
    if world is not None:
        try:
            actor.validate(world, data.train_batch_size)
            dp = actor.data_parallel_size(world)
            rows = None if dp is None else data.train_batch_size * actor.rollout_n // dp
        except ValueError as exc:
            problems.append(str(exc))
    problems += actor.token_budget_problems(seq)
    for node in (rollout, *([worker["ref"]] if actor.use_kl_loss else [])):  # the forward-only passes of a step
        problems += node.log_prob_problems(rows, seq)
    return problems


def check_device(trainer: TrainerConfig | None, cluster: bool) -> tuple[str | None, list[str]]:
    """The device type the ranks compute on, for a local run (``cluster=False``), with its problems (none known
    while the ``trainer`` node does not build: its lines say why).

    On a Ray cluster the device is decided from the cluster's resources instead (``check_cluster``).
    """
    if trainer is None:
        return None, []
    requested = trainer.device
    if cluster:
        return (None if requested == "auto" else requested), []
    if trainer.nnodes > 1:
        return None, [f"trainer.nnodes={trainer.nnodes} needs a Ray cluster: set RAY_ADDRESS (or submit with `ray job submit`), or set trainer.nnodes=1"]
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
    if device != "cpu" and trainer.n_gpus_per_node > get_torch_device().device_count():
        count = get_torch_device().device_count()
        return None, [f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} but this host has {count} {device} device(s); set trainer.n_gpus_per_node={count}"]
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


def check_cluster(trainer: TrainerConfig, requested: str | None, resources: dict, alive_nodes: int) -> tuple[str, list[str]]:
    """Device and capacity of the Ray cluster the run joined."""
    gpus = int(resources.get("GPU", 0))
    device = requested or ("cuda" if gpus else "cpu")
    problems = []
    if alive_nodes < trainer.nnodes:
        problems.append(f"trainer.nnodes={trainer.nnodes} but the Ray cluster has {alive_nodes} node(s); set trainer.nnodes={alive_nodes}")
    if device == "cuda" and gpus < trainer.world_size:
        problems.append(f"{trainer.world_size} ranks need as many GPUs but the Ray cluster has {gpus}; set trainer.n_gpus_per_node / trainer.nnodes (or trainer.device=cpu)")
    return device, problems


def check_model_build(model_path: str, config: Any) -> list[str]:
    """The full pre-start check of the model (mbridge support, exact representability, layout, the bridge's HF
    save arguments), all problems at once; ``config`` passed ``check_config``."""
    from verl.models.mcore import UnsupportedHFConfigError, validate_model_build
    from verl.utils.custom_code import CustomCodeError

    actor = build_megatron_actor_configs(OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True))
    try:
        hf_config = validate_model_build(model_path, ParallelSizes.from_megatron(actor.megatron), trainer_config_or_none(config).world_size)
    except UnsupportedHFConfigError as exc:
        return [f"actor_rollout_ref.model.path={model_path}: {p}" for p in exc.problems]
    except ParallelConfigError as exc:
        return exc.problems
    except (FileNotFoundError, CustomCodeError) as exc:
        return [str(exc)]
    vanilla_mbridge = actor.megatron.vanilla_mbridge
    if not vanilla_mbridge and megatron_bridge_install_problem(vanilla_mbridge) is None:  # else check_config says so
        from verl.models.mcore.bridge import megatron_bridge_family_problem

        family = megatron_bridge_family_problem(hf_config)
        if family is not None:
            return [f"actor_rollout_ref.model.path={model_path}: {family}"]
    return actor.checkpoint.mbridge_config_problems(hf_config.model_type, vanilla_mbridge, key=f"{_CHECKPOINT}mbridge_config")
