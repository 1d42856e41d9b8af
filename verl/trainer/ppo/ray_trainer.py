"""The trainer on the driver: drives the Megatron actor worker group step by step, saves and resumes.

Until GRPO lands, a step is one actor update on a synthetic token batch that depends only on
``data.seed`` and the step number, so a resumed run sees exactly the data an uninterrupted one would.

Saves follow upstream verl: every ``trainer.save_freq`` steps (and at the last step) the workers save
``<default_local_dir>/global_step_N/actor``; only after every rank returned does the driver check the
step on disk and write ``<default_local_dir>/latest_checkpointed_iteration.txt`` (atomically). A crash
anywhere before that leaves the tracker on the previous complete step.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from omegaconf import OmegaConf

from verl.single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool
from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
from verl.utils.fs import atomic_write_text, local_mkdir_safe
from verl.workers.megatron_workers import ActorRolloutRefWorker

METRICS_FILENAME = "metrics.jsonl"
# Synthetic sequences use token ids from here up (below are the tokenizer's specials).
_FIRST_TOKEN = 4


def make_synthetic_batch(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` token rows for ``step``: each row an arithmetic progression (random start
    and stride, modulo the usable vocabulary), so there is something to learn. Same (seed, step): same rows."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    span = min(vocab_size, 96) - _FIRST_TOKEN
    start = torch.randint(0, span, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 6, (batch_size, 1), generator=generator)
    positions = torch.arange(seq_len + 1).unsqueeze(0)
    return _FIRST_TOKEN + (start + stride * positions) % span


class RayPPOTrainer:
    def __init__(self, config: Any, model_path: str, vocab_size: int, device: str, resume: tuple[int, str] | None) -> None:
        self.config = config
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.device = device
        self.resume = resume
        self.default_local_dir = os.path.abspath(os.path.expanduser(str(config.trainer.default_local_dir)))
        self.total_training_steps = int(config.trainer.total_training_steps)
        self.save_freq = int(config.trainer.save_freq)
        self.global_steps = 0
        self.actor_rollout_wg: MegatronRayWorkerGroup | None = None
        loggers = config.trainer.logger
        self.loggers = [loggers] if isinstance(loggers, str) else list(loggers)
        self.metrics_path = os.path.join(self.default_local_dir, METRICS_FILENAME)
        self.saved: list[dict] = []

    # ------------------------------------------------------------------ workers

    def init_workers(self) -> None:
        trainer = self.config.trainer
        worker_config = OmegaConf.to_container(self.config.actor_rollout_ref, resolve=True)
        worker_config["model"]["path"] = self.model_path
        pool = RayResourcePool(
            [int(trainer.n_gpus_per_node)] * int(trainer.nnodes), use_gpu=self.device == "cuda", name_prefix="actor_rollout"
        )
        start = time.monotonic()
        self.actor_rollout_wg = MegatronRayWorkerGroup(
            pool,
            RayClassWithInitArgs(ActorRolloutRefWorker, config=worker_config, role="actor"),
            init_timeout_s=float(trainer.ray_wait_register_center_timeout),
        )
        wg = self.actor_rollout_wg
        self._print(
            f"[trainer] {wg.world_size} ranks up in {time.monotonic() - start:.1f}s "
            f"(TP {wg.tp_size} x PP {wg.pp_size} x CP {wg.cp_size} x DP {wg.dp_size}, device {self.device})"
        )
        start = time.monotonic()
        built = wg.init_model()
        self._print(f"[trainer] model built on every rank in {time.monotonic() - start:.1f}s ({built[0]['num_params']:,} parameters on rank 0)")

    def shutdown(self) -> None:
        if self.actor_rollout_wg is not None:
            self.actor_rollout_wg.shutdown()
            self.actor_rollout_wg = None

    # ------------------------------------------------------------------ loop

    def fit(self) -> None:
        self.global_steps = self._load_checkpoint()
        if self.global_steps >= self.total_training_steps:  # main_ppo stops before starting ranks; kept for other callers
            self._print(f"[trainer] step {self.global_steps} >= trainer.total_training_steps={self.total_training_steps}: nothing to train")
            return
        data = self.config.data
        seq_len = int(data.max_prompt_length) + int(data.max_response_length)
        for step in range(self.global_steps + 1, self.total_training_steps + 1):
            self.global_steps = step
            start = time.monotonic()
            batch = make_synthetic_batch(int(data.seed), step, int(data.train_batch_size), seq_len, self.vocab_size)
            results = self.actor_rollout_wg.update_actor(list(batch.chunk(self.actor_rollout_wg.dp_size)))
            metrics = {
                "step": step,
                "loss": sum(r["loss"] for r in results) / len(results),
                "grad_norm": results[0]["grad_norm"],
                "lr": results[0]["lr"],
                "update_ok": all(r["update_ok"] for r in results),
                "step_time_s": round(time.monotonic() - start, 3),
            }
            self._print(
                f"[trainer] step {step}/{self.total_training_steps}  loss {metrics['loss']:.6f}  "
                f"grad_norm {metrics['grad_norm']:.4f}  time {metrics['step_time_s']:.1f}s"
            )
            is_last_step = step >= self.total_training_steps
            if self.save_freq > 0 and (is_last_step or step % self.save_freq == 0):
                metrics["checkpoint"] = self._save_checkpoint()
            self._log_metrics(metrics)
        self._summary()

    # ------------------------------------------------------------------ checkpoints

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.default_local_dir, f"global_step_{step}")

    def _load_checkpoint(self) -> int:
        if self.resume is None:
            self._print(f"[trainer] starting from scratch (trainer.resume_mode={self.config.trainer.resume_mode})")
            return 0
        step, path = self.resume
        start = time.monotonic()
        self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        self._print(f"[trainer] resumed from {path} (step {step}) in {time.monotonic() - start:.1f}s")
        return step

    def _save_checkpoint(self) -> dict:
        step = self.global_steps
        actor_path = os.path.join(self._step_dir(step), "actor")
        start = time.monotonic()
        keep = self.config.trainer.max_actor_ckpt_to_keep
        results = self.actor_rollout_wg.save_checkpoint(actor_path, global_step=step, max_ckpt_to_keep=keep)
        seconds = time.monotonic() - start
        verified = verify_saved_step(actor_path)
        # Every rank returned and the step checks out: only now does the tracker move to it.
        atomic_write_text(get_checkpoint_tracker_filename(self.default_local_dir), str(step))
        record = {
            "path": actor_path,
            "save_time_s": round(seconds, 3),
            "module_device": results[0]["module_device"],
            "param_offloaded_before": results[0]["param_offloaded_before"],
            "param_offloaded_after": all(r["param_offloaded_after"] for r in results),
            **verified,
        }
        self.saved.append(record)
        offload = ""
        if record["param_offloaded_before"]:
            after = "offloaded again" if record["param_offloaded_after"] else "NOT offloaded again"
            offload = f"\n[trainer]   param_offload: the weights were offloaded; brought back for the save, then {after}"
        self._print(
            f"[trainer] saved step {step} in {seconds:.1f}s -> {actor_path}\n"
            f"[trainer]   verified: {verified['files']} files match the manifest; contents {verified['contents']}"
            + (f"; HF export: {verified['hf']}" if verified.get("hf") else "")
            + offload
            + f"\n[trainer]   tracker {get_checkpoint_tracker_filename(self.default_local_dir)} -> {step}"
        )
        return record

    # ------------------------------------------------------------------ output

    def _print(self, message: str) -> None:
        if "console" in self.loggers:
            print(message, flush=True)

    def _log_metrics(self, metrics: dict) -> None:
        if "file" not in self.loggers:
            return
        local_mkdir_safe(self.default_local_dir)
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps({**metrics, "time": time.time()}) + "\n")

    def _summary(self) -> None:
        lines = [f"[trainer] done: {self.total_training_steps} steps; checkpoints under {self.default_local_dir}"]
        if self.saved:
            last = self.saved[-1]
            lines.append(f"[trainer]   latest: {last['path']} (tracker latest_checkpointed_iteration.txt -> {self.global_steps})")
            lines.append("[trainer]   verified at every save: manifest files present with their sizes, ckpt_contents.json"
                         + ("; HF export complete (every tensor the config implies, right shapes)" if last.get("hf") else ""))
        if "file" in self.loggers:
            lines.append(f"[trainer]   metrics: {self.metrics_path}")
        print("\n".join(lines), flush=True)


def verify_saved_step(actor_path: str) -> dict:
    """Check a saved step from the driver, as a load would (independently of the ranks that wrote it):
    every file the manifest lists with its size, ``ckpt_contents.json``, and an HF export holding every
    tensor the HF config implies. Raises ``CheckpointError`` otherwise."""
    from verl.utils.checkpoint.integrity import MANIFEST_FILENAME, verify_checkpoint

    contents = verify_checkpoint(actor_path)
    with open(os.path.join(actor_path, MANIFEST_FILENAME)) as handle:
        files = len(json.load(handle)["files"])
    result = {"files": files, "contents": contents["save_contents"]}
    if "hf_model" in contents["save_contents"]:
        from verl.utils.checkpoint.hf_verify import verify_hf_checkpoint
        from verl.utils.megatron_utils import get_hf_model_checkpoint_path

        report = verify_hf_checkpoint(get_hf_model_checkpoint_path(actor_path))
        result["hf"] = f"all {report.expected} tensors present with the expected shapes"
    return result
