"""``python -m verl.trainer.main_ppo [key=value ...]``: the Hydra entry point of the trainer.

What happens, in order:

1. a null ``actor_rollout_ref.rollout.name`` becomes ``vllm`` where ``import vllm`` works, ``hf`` otherwise (one
   line says which); the config is checked (``verl.trainer.validation``): every problem is printed on its own line, naming
   the override that fixes it, and the process exits with status 2 before Ray or any rank starts;
2. with ``actor_rollout_ref.model.path=null`` the embedded tiny Qwen3-MoE is made once into a cache
   directory (``$VERL_TINY_MODEL_CACHE`` or ``~/.cache/verl_tiny``), and the model is checked against
   the parallel layout;
3. Ray starts locally, or the run joins the cluster in ``RAY_ADDRESS`` (what ``ray job submit`` sets);
4. one Ray actor per rank, then the GRPO trainer: rollout, reward, update, periodic saves, resume.

A run that writes into ``trainer.default_local_dir`` holds its writer lock from the end of the cheap checks
until it exits (a second run on it exits with status 2). SIGINT / SIGTERM stop the ranks and Ray, then print
one line naming the committed step and the command to resume; the exit status is 130 / 143.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import hydra

from verl.trainer.cli_overrides import override_problems
from verl.trainer.config.rollout_choice import choose_rollout, with_rollout_named
from verl.trainer.data_plan import RunData, load_run_data, load_tokenizer
from verl.trainer.ignored_keys import ignored_settings
from verl.trainer.resume_step import check_resume_step, data_position_problems, schedule_length_warning
from verl.trainer.run_config import ConfigError, RunConfig, build_run_config, trainer_config_or_none
from verl.trainer.run_control import StopSignals, output_dir, stop_message, take_writer_lock
from verl.trainer.validation import check_async_mode, check_cluster, check_model_build, pre_start_problems
from verl.utils.checkpoint.dir_lock import DirLock, DirLockError
from verl.utils.logging_utils import silence_library_notices
from verl.utils.megatron.parallel import ParallelSizes

EXIT_CONFIG_ERROR = 2
EMBEDDED_MODEL_NAME = "tiny_qwen3_moe_l4_e8_v1"


@hydra.main(config_path="config", config_name="ppo_megatron_trainer", version_base=None)
def main(config) -> None:
    run_ppo(config)


@dataclass
class RunPlan:
    model_path: str
    device: str | None  # None: decided from the Ray cluster's resources
    cluster: bool
    resume: tuple[int, str] | None
    # What the pre-start check proved of the resumed step (``resume_check.CheckedStep``): the ranks do not repeat it.
    resume_checked: Any = None
    # Every node the run reads, typed (its actor's schedule length filled in), built once here and handed down.
    run: RunConfig | None = None
    # trainer.default_local_dir's writer lock, held until the process exits (None: the run writes nothing there).
    dir_lock: DirLock | None = None
    # The prompts (tokenized), the run's prompt length and step count (verl.trainer.data_plan).
    data: RunData | None = None
    tokenizer: Any = None


def prepare(config) -> RunPlan:
    """Every check that can run before Ray starts; raises ConfigError with all problems found. A null
    ``rollout.name`` is filled first (vllm where ``import vllm`` works, hf otherwise), so the checks and the
    typed config see the rollout the run takes."""
    cluster = bool(os.environ.get("RAY_ADDRESS"))
    print(f"[main_ppo] {choose_rollout(config)}", flush=True)
    model_path, device, problems = pre_start_problems(config, cluster)
    if problems:
        raise ConfigError(problems)
    if model_path is None:
        model_path = embedded_model_path()
        _, _, problems = pre_start_problems(config, cluster, model_path)
        if problems:
            raise ConfigError(problems)
    run = build_run_config(config)
    # Before the slow checks and before the resume step is read: one writer per checkpoint directory.
    dir_lock = take_writer_lock(run.trainer)
    if dir_lock is not None:  # the lock held: no other run is between the two renames of a commit here
        from verl.utils.checkpoint.step_commit import put_back_superseded  # torch: not at the driver's import

        for note in put_back_superseded(output_dir(run.trainer)):
            print(f"[main_ppo] note: {note}", flush=True)
    try:
        # The tokenizer and the data first: a bad data file or template is refused in seconds, before the model
        # build check imports Megatron.
        tokenizer = load_tokenizer(run, model_path)
        data = load_run_data(run, tokenizer)
        problems = check_model_build(model_path, config)
        if problems:
            raise ConfigError(problems)
        found = check_resume_step(run, model_path)
        resume, resume_checked = (None, None) if found is None else ((found.step, found.step_dir), found.checked)
        if resume is not None:
            problems = data_position_problems(resume[1], run.data, len(data.train))
            if problems:
                raise ConfigError(problems)
        run.set_training_steps(data.total_training_steps)
    except ConfigError:
        if dir_lock is not None:
            dir_lock.discard()
        raise
    return RunPlan(
        model_path=model_path, device=device, cluster=cluster, resume=resume, resume_checked=resume_checked, run=run,
        dir_lock=dir_lock, data=data, tokenizer=tokenizer,
    )  # fmt: skip


def embedded_model_path() -> str:
    """The embedded tiny Qwen3-MoE, made on first use (atomically: concurrent runs never see half of it)."""
    from verl.models.tiny import make_tiny_hf_model

    root = os.environ.get("VERL_TINY_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "verl_tiny")
    final = os.path.join(root, EMBEDDED_MODEL_NAME)
    marker = os.path.join(final, ".complete")
    if os.path.isfile(marker):
        return final
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}.", dir=root)
    try:
        make_tiny_hf_model(staging, kind="moe", seed=0)
        with open(os.path.join(staging, ".complete"), "w") as handle:
            handle.write("made by verl.trainer.main_ppo\n")
        if os.path.isdir(final) and not os.path.isfile(marker):
            shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover
        try:
            os.rename(staging, final)
        except OSError:
            if not os.path.isfile(marker):  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"[main_ppo] made the embedded tiny Qwen3-MoE at {final}", flush=True)
    return final


def _init_ray(run: RunConfig) -> bool:
    """Start a local Ray instance, or join RAY_ADDRESS's cluster. True when this process started Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        print(f"[main_ppo] joined the Ray cluster at {address}", flush=True)
        return True
    kwargs = ray_init_kwargs(run.ray_init)
    for attempt in (1, 2):
        try:
            ray.init(address="local", **kwargs)
            return True
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a slow raylet
            # Ray gives a local raylet a fixed 30 s to register; an overloaded host can miss that once.
            ray.shutdown()
            if attempt == 2:
                raise
            print(f"[main_ppo] starting a local Ray instance failed ({exc}); trying once more", flush=True)
    return True


def ray_init_kwargs(ray_init: dict) -> dict:
    """``ray.init`` keyword arguments from upstream's ``ray_kwargs.ray_init`` (num_cpus null: this host's CPUs;
    a null ``runtime_env.py_executable``: the rank actors run this interpreter)."""
    kwargs = dict(ray_init)
    kwargs["num_cpus"] = int(kwargs.get("num_cpus") or os.cpu_count() or 1)
    runtime_env = {key: value for key, value in (kwargs.pop("runtime_env", None) or {}).items() if value is not None}
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    kwargs.setdefault("include_dashboard", False)
    if "_temp_dir" not in kwargs and not os.environ.get("RAY_TMPDIR"):
        kwargs["_temp_dir"] = private_ray_temp_dir()
    return kwargs


def private_ray_temp_dir() -> str:
    """``<tmp>/ray-<uid>/ray`` for a local Ray instance, inside a 0700 directory: Ray's default ``/tmp/ray`` is 0777
    without the sticky bit (Ray makes the temp dir it is given 0777 too), so any user of the host could replace
    its session files, sockets and logs."""
    path = os.path.join(tempfile.gettempdir(), f"ray-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory of this user's (a link, or another user's): remove it, or set RAY_TMPDIR")
    os.chmod(path, 0o700)
    return os.path.join(path, "ray")


def run_ppo(config, task_runner_class: type | None = None) -> None:
    """Validate ``config``, start Ray and the ranks, train. ``task_runner_class`` is upstream's hook for a
    recipe's own TaskRunner; this trainer has no TaskRunner, so one is refused before anything starts."""
    if task_runner_class is not None:
        raise NotImplementedError(
            f"run_ppo(task_runner_class={task_runner_class!r}): this package has no TaskRunner to replace; call run_ppo(config)"
        )
    silence_library_notices()
    stops = StopSignals()
    stops.install()
    progress: dict = {}
    try:
        _run(config, stops, progress)
    except KeyboardInterrupt:
        # _run's finally blocks have stopped the ranks and Ray by now.
        trainer = progress.get("trainer")
        step = trainer.global_steps if trainer is not None else None
        pending = trainer.pending_step() if trainer is not None else None
        signum = stops.signum or signal.SIGINT
        trainer_config = progress["run"].trainer if "run" in progress else trainer_config_or_none(config)
        argv = with_rollout_named(sys.argv[1:], progress["run"].rollout.name) if "run" in progress else sys.argv[1:]
        print(stop_message(trainer_config, signum, step, pending, argv), file=sys.stderr, flush=True)
        raise SystemExit(stops.exit_code()) from None


def _run(config, stops: StopSignals, progress: dict) -> None:
    try:
        plan = prepare(config)
    except ConfigError as err:
        _exit_config_error(err)
    except DirLockError as err:
        print(f"[main_ppo] {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    progress["run"] = run = plan.run
    total = plan.data.total_training_steps
    if plan.resume and plan.resume[0] >= total:
        print(
            f"[main_ppo] {plan.resume[1]} (step {plan.resume[0]}) is already at trainer.total_training_steps={total}: "
            "nothing to train. It was verified before this message (the manifest, the contents file, HF export). Raise "
            "trainer.total_training_steps to continue, or set trainer.resume_mode=disable to start over.",
            flush=True,
        )
        return
    if plan.resume:
        warning = schedule_length_warning(plan.resume[1], run.actor.optim)
        if warning:
            print(f"[main_ppo] warning: {warning}", flush=True)
    import ray

    from verl.single_controller.ray import WorkerGroupError
    from verl.trainer.ppo.log_prob_parity import LogProbParityError
    from verl.trainer.ppo.ray_trainer import MegatronGRPOTrainer
    from verl.trainer.shared_dir import SharedDirError
    from verl.utils.checkpoint.finite import DivergedError

    started = _init_ray(run)
    stops.install()  # ray.init replaced the SIGTERM handler with one that tears Ray down under this process
    try:
        device = plan.device
        if plan.cluster:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            device, problems = check_cluster(run.trainer, plan.device, ray.cluster_resources(), alive)
            problems += check_async_mode(config, device)
            if problems:
                _exit_config_error(ConfigError(problems))
        _print_plan(config, plan, device)
        trainer = MegatronGRPOTrainer(
            run, plan.model_path, device, plan.resume, data=plan.data, tokenizer=plan.tokenizer,
            resume_checked=plan.resume_checked,
        )  # fmt: skip
        progress["trainer"] = trainer
        try:
            trainer.init_workers()
            trainer.fit()
        except SharedDirError as err:
            print(f"[main_ppo] {err}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG_ERROR) from None
        except WorkerGroupError as err:
            print(f"[main_ppo] training failed:\n{err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except LogProbParityError as err:
            print(f"[main_ppo] training stopped before the first update: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except DivergedError as err:
            print(f"[main_ppo] training stopped: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        finally:
            trainer.shutdown()
    finally:
        if started:
            ray.shutdown()


def _print_plan(config, plan: RunPlan, device: str) -> None:
    run = plan.run
    megatron, trainer = run.actor.megatron, run.trainer
    sizes = ParallelSizes.from_megatron(megatron)
    resume = f"resume from {plan.resume[1]}" if plan.resume else f"start fresh (resume_mode={trainer.resume_mode})"
    print(
        f"[main_ppo] model {plan.model_path}\n"
        f"[main_ppo] {trainer.world_size} ranks on {device} ({trainer.nnodes} node(s) x {trainer.n_gpus_per_node}); "
        f"TP{sizes.tp} PP{sizes.pp}{f' VPP{sizes.virtual_stages}' if sizes.virtual_stages else ''} EP{sizes.ep} ETP{sizes.expert_tp} CP{sizes.cp}; "
        f"use_distributed_optimizer={megatron.use_distributed_optimizer} param_offload={megatron.param_offload}\n"
        f"[main_ppo] {plan.data.total_training_steps} steps, save_freq={trainer.save_freq}, "
        f"checkpoints -> {output_dir(trainer)}; {resume}\n"
        f"[main_ppo] bridge: {bridge_line(megatron)}",
        flush=True,
    )
    for note in plan.data.notes:
        print(f"[main_ppo] {note}", flush=True)
    ignored = ignored_settings(config)
    if ignored:
        print("[main_ppo] accepted but ignored (no effect here):\n" + "\n".join(f"[main_ppo]   {line}" for line in ignored), flush=True)


def bridge_line(megatron: Any) -> str:
    """Which HF <-> Megatron bridge builds the model (actor and reference), and the key that chose it."""
    name = "mbridge" if megatron.vanilla_mbridge else "Megatron-Bridge"
    return f"{name} (use_mbridge={megatron.use_mbridge}, vanilla_mbridge={megatron.vanilla_mbridge}; upstream's default: Megatron-Bridge)"


def _exit_config_error(err: ConfigError) -> None:
    print(f"[main_ppo] {err}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG_ERROR)


def cli(argv: list[str]) -> None:
    """main_ppo's command line: overrides Hydra could not compose are refused one line each, then Hydra runs."""
    problems = override_problems(argv)
    if problems:
        _exit_config_error(ConfigError(problems))
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
