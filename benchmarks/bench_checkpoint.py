"""Checkpoint save / load benchmark: per-phase times, bytes, disk bandwidth, peak RSS, HF export vs mbridge.

Makes a fixed Qwen3-MoE of about ``--params`` parameters (fp32) with ``verl.models.tiny``, then for
each layout -- (TP,PP,EP,ETP) = (2,2,2,2) on 8 ranks, (1,2,2,1) on 4 and (1,1,1,1) on 1 -- every rank:

1. builds the actor (HF load through the bridge, DDP model, Adam), trains one step so the optimizer
   holds state, and counts its model + optimizer state bytes (params, grads, Adam moments);
2. saves a full checkpoint (model, optimizer, extra, hf_model) through MegatronCheckpointManager
   three times (cold, plan validated, warm: the plan reused); the manager's own phase times are read
   from the committed record (``MegatronEngine.last_committed.phase_seconds``: the writer's phases and the commit's);
3. saves it twice more with ``async_save``, once with each async writer (``checkpoint.async_mode``, set on
   the manager between saves): ``snapshot`` (the fourth save of one structure: the whole save runs in a
   process forked from each rank), then ``background_write`` (the same fork, reading a host copy the rank took
   of what lives in device memory: a CUDA host's path): how long the call blocks training, where that time goes (the save's
   report), and how long the background part takes until ``finalize_async_save`` has committed the step;
4. loads it back (model, optimizer, extra), timed;
5. exports HF weights standalone with the bridge's parallel ``save_weights`` and with mbridge's own
   ``save_weights`` (everything gathered to rank 0: the baseline), timed, and compares the files.

Peak RSS per rank is the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs) of
the rank; a sampler records the RSS (every 50 ms) and the unique memory (USS, every 250 ms) of its
child processes (dist-checkpoint writers, the async save's forks), which share most pages with it.
The disk's sequential write bandwidth is measured in the same run: 512 MiB written and fsynced.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.bench_checkpoint                       # ~150M params, both layouts
    .venv/bin/python -m benchmarks.bench_checkpoint --params 40e6 --out outputs/bench_40m.json
    .venv/bin/python -m benchmarks.bench_checkpoint --layouts 1          # one rank only

Targets (docs/perf.md) are reported, never enforced: the exit status is 0 whatever they say.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time

# Only the standard library and the shared helper at the top: megatron's dist-checkpoint writer starts a helper
# process with "spawn", which imports this file again; torch and megatron are imported where they are used.
from benchmarks.common import MiB, engine, machine, make_model, model_overrides, state_bytes, tree_bytes

LAYOUTS = {8: (2, 2, 2, 2), 4: (1, 2, 2, 1), 1: (1, 1, 1, 1)}  # world size -> (TP, PP, EP, ETP)
TARGETS = {
    "dist_ckpt_vs_disk": 0.5,  # dist-ckpt save throughput >= 0.5x disk write bandwidth
    "hf_export_speedup_8ranks": 2.0,  # HF export >= 2x faster than mbridge's save_weights at 8 ranks
    "verify_share_of_save": 0.10,  # verification adds <= 10% to a save
    "load_vs_save": 1.0,  # load time <= save time
    "peak_rss_vs_state": 1.25,  # peak RSS per rank during save <= 1.25x model+optimizer state
    "async_blocked_vs_sync": 0.02,  # async save: training blocked <= 2% of a sync save
}


# --------------------------------------------------------------------------- model


# --------------------------------------------------------------------------- measuring


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE).group(1))


class PeakRSS:
    """This process's peak RSS (VmHWM after a reset) and its children's peak RSS (sampled)."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._children_peak = self._children_uss_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hwm_reset = True

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            self.hwm_reset = False
        self._children_peak = self._children_uss_peak = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        ticks = 0
        while not self._stop.wait(0.05):
            ticks += 1
            total = unique = 0
            for child in self._me.children(recursive=True):
                try:
                    total += child.memory_info().rss
                    if ticks % 5 == 0:  # reading smaps is slow: every 0.25 s
                        unique += child.memory_full_info().uss
                except psutil.Error:
                    pass
            self._children_peak = max(self._children_peak, total)
            self._children_uss_peak = max(self._children_uss_peak, unique)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"self": _status_kib("VmHWM") * 1024, "children": self._children_peak, "children_uss": self._children_uss_peak}


def rss_now() -> int:
    return _status_kib("VmRSS") * 1024


def disk_write_bandwidth(directory: str, size: int = 512 * MiB) -> dict:
    """Sequential write of ``size`` bytes in 8 MiB blocks, then fsync; bytes per second."""
    block = os.urandom(8 * MiB)
    path = os.path.join(directory, "disk_bench.bin")
    start = time.monotonic()
    with open(path, "wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)
        buffered = time.monotonic() - start
        handle.flush()
        os.fsync(handle.fileno())
    total = time.monotonic() - start
    os.remove(path)
    return {"bytes": size, "fsync_s": total, "fsync_Bps": size / total, "buffered_Bps": size / buffered}


def serialization_bandwidth(directory: str, size: int = 512 * MiB, item: int = 720 * 1024) -> dict:
    """The ceiling of the torch_dist format on this CPU: one process ``torch.save``-ing ``size`` bytes of
    fp32 tensors of ``item`` bytes each (the size of this model's typical expert slice) into one file,
    then fsync -- what a dist-ckpt writer does per item, without any planning."""
    import torch

    tensors = [torch.rand(item // 4) for _ in range(size // item)]
    path = os.path.join(directory, "serialization_bench.bin")
    start = time.monotonic()
    with open(path, "wb") as handle:
        for tensor in tensors:
            torch.save(tensor, handle)
        handle.flush()
        os.fsync(handle.fileno())
    total = time.monotonic() - start
    os.remove(path)
    return {"bytes": size // item * item, "torch_save_fsync_Bps": size // item * item / total}


def folder_digest(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        digest = hashlib.sha256()
        with open(os.path.join(path, name), "rb") as handle:
            for chunk in iter(lambda: handle.read(16 * MiB), b""):
                digest.update(chunk)
        out[name] = digest.hexdigest()
    return out


# --------------------------------------------------------------------------- one rank


def _timed_collective(fn, *args) -> float:
    import torch

    torch.distributed.barrier()
    start = time.monotonic()
    fn(*args)
    torch.distributed.barrier()
    return time.monotonic() - start


def _save(actor, step_dir: str, step: int, peak: PeakRSS) -> dict:
    """One timed save; on rank 0 also its phases and the bytes it wrote."""
    import torch

    from verl.utils.checkpoint import layout

    gc.collect()
    torch.distributed.barrier()
    out = {"rss_before": rss_now()}
    ended: list[float] = []
    peak.start()
    out["save_s"] = _timed_collective(lambda: (actor.save_checkpoint(step_dir, global_step=step), ended.append(time.monotonic())))
    out["peak"] = peak.stop()
    if torch.distributed.get_rank() == 0:
        out["phases"] = dict(actor.last_committed.phase_seconds)  # the committed record: the writer's phases and the commit's
        out["bytes"] = {
            **{f"{content}_dist_ckpt": tree_bytes(layout.dist_path(step_dir, content)) for content in ("model", "optimizer", "extra")},
            "huggingface": tree_bytes(layout.hf_path(step_dir)),
            "total": tree_bytes(step_dir),
        }
    return out


def _save_async(actor, step_dir: str, step: int, peak: PeakRSS, mode: str) -> dict:
    """One async save with ``mode``'s writer: the time the call blocks, where it goes (the
    save's report), then the background write until finalized."""
    import torch

    manager = actor.checkpoint_manager
    manager.async_save, manager.async_mode = True, mode
    gc.collect()
    torch.distributed.barrier()
    rss_before = rss_now()
    peak.start()
    out = {"blocked_s": _timed_collective(lambda: actor.save_checkpoint(step_dir, global_step=step)), "rss_before": rss_before}
    report = manager.last_save
    out["mode"] = report.mode.value
    out["from_snapshot"] = report.planned_in_background
    out["manager_blocked_s"] = report.blocked_seconds
    out["hf_weights_in_background"] = report.hf_weights_in_background
    out["phases"] = dict(report.phase_seconds)  # in the rank, before save_checkpoint returned
    out["finalize_s"] = _timed_collective(actor.finalize_checkpoint)
    out["phases_after_finalize"] = dict(actor.last_committed.phase_seconds)
    out["peak"] = peak.stop()
    manager.async_save = False
    return out


def bench_rank(model_path: str, work: str) -> dict:
    import torch

    rank = torch.distributed.get_rank()
    out: dict = {"rank": rank, "rss_runtime": rss_now()}
    peak = PeakRSS()
    start = time.monotonic()
    actor = engine(model_path, "megatron.dtype=float32")
    data = torch.randint(4, 90, (4, 33), generator=torch.Generator().manual_seed(0))
    actor.train_step([data[:2], data[2:]])
    out["build_and_train_s"] = time.monotonic() - start
    out["state"] = state_bytes(actor)

    # The first save of a process also starts megatron's writer helper process (spawn).
    out["cold"] = _save(actor, os.path.join(work, "ckpt", "global_step_1", "actor"), 1, peak)
    # The second save validates megatron's cached save plan; the third and later reuse it.
    _save(actor, os.path.join(work, "ckpt", "global_step_2", "actor"), 2, peak)
    step_dir = os.path.join(work, "ckpt", "global_step_3", "actor")
    out["warm"] = _save(actor, step_dir, 3, peak)
    out["async"] = _save_async(actor, os.path.join(work, "ckpt", "global_step_4", "actor"), 4, peak, "snapshot")
    out["async_background_write"] = _save_async(actor, os.path.join(work, "ckpt", "global_step_5", "actor"), 5, peak, "background_write")

    gc.collect()
    peak.start()
    out["load_s"] = _timed_collective(actor.load_checkpoint, step_dir)
    out["peak_load"] = peak.stop()

    fast_dir, mbridge_dir = os.path.join(work, "hf_parallel"), os.path.join(work, "hf_mbridge")
    gc.collect()
    peak.start()
    out["hf_parallel_s"] = _timed_collective(actor.bridge.save_weights, actor.model, fast_dir)
    out["peak_hf_parallel"] = peak.stop()
    gc.collect()
    peak.start()
    out["hf_mbridge_s"] = _timed_collective(actor.bridge.save_weights_gathered, actor.model, mbridge_dir)
    out["peak_hf_mbridge"] = peak.stop()
    if rank == 0:
        out["hf_identical"] = folder_digest(fast_dir) == folder_digest(mbridge_dir)
    torch.distributed.barrier()
    return out


# --------------------------------------------------------------------------- driver


def run_layout(world: int, model_path: str, work: str, timeout_s: float) -> dict:
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    tp, pp, ep, etp = LAYOUTS[world]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    start = time.monotonic()
    ranks = run_on_ranks(
        bench_rank, world, ParallelSizes(tp, pp, ep, etp), args=(model_path, work), timeout_s=timeout_s
    )
    wall = time.monotonic() - start
    shutil.rmtree(work, ignore_errors=True)
    return summarize(world, ranks, wall)


def _save_summary(save: dict) -> dict:
    phases = dict(save["phases"])
    named = ("finite_check", "staging", "dist_checkpoints", "hf_config", "hf_weights", "metadata", "hf_verify", "commit")
    phases["other"] = max(0.0, save["save_s"] - sum(phases.get(k, 0.0) for k in named))  # barriers, retention
    dist_bytes = sum(save["bytes"][k] for k in ("model_dist_ckpt", "optimizer_dist_ckpt", "extra_dist_ckpt"))
    return {
        "save_s": save["save_s"],
        "phases_s": phases,
        "bytes": save["bytes"],
        "dist_ckpt_Bps": dist_bytes / phases["dist_checkpoints"],
    }


# what an async save may run in the rank: the actor's NaN/Inf check and staging directory, then the manager's phases
BLOCKING_PHASES = ("finite_check", "staging", "dist_checkpoints", "hf_config", "hf_weights", "fork")


def _async_summary(ranks: list[dict], key: str) -> dict:
    """One async save, from the slowest rank's view of its blocking phases (rank 0's for the rest)."""
    saves = [r[key] for r in ranks]
    r0 = saves[0]
    blocked_by_phase = {p: max(s["phases"].get(p, 0.0) for s in saves) for p in BLOCKING_PHASES}
    # the rest of the blocked time: barriers between the phases (waiting for the slowest rank), the report itself
    blocked_by_phase["other"] = max(0.0, r0["blocked_s"] - sum(blocked_by_phase.values()))
    return {
        "mode": r0["mode"],
        "from_snapshot": r0["from_snapshot"],
        "hf_weights_in_background": r0["hf_weights_in_background"],
        "blocked_s": r0["blocked_s"],
        "manager_blocked_s_max": max(s["manager_blocked_s"] for s in saves),
        "blocked_by_phase_s": blocked_by_phase,
        "finalize_s": r0["finalize_s"],
        "phases_s": r0["phases_after_finalize"],
    }


def summarize(world: int, ranks: list[dict], wall: float) -> dict:
    r0 = ranks[0]
    per_rank = []
    for r in ranks:
        state = r["state"]["total"]
        peak = r["warm"]["peak"]["self"]
        per_rank.append(
            {
                "rank": r["rank"],
                "state_MiB": state / MiB,
                "rss_runtime_MiB": r["rss_runtime"] / MiB,
                "rss_before_save_MiB": r["warm"]["rss_before"] / MiB,
                "peak_save_MiB": peak / MiB,
                "peak_save_cold_MiB": r["cold"]["peak"]["self"] / MiB,
                "peak_save_async_MiB": r["async"]["peak"]["self"] / MiB,
                "peak_save_async_children_MiB": r["async"]["peak"]["children"] / MiB,
                # memory of the forked writers not shared with the rank (their clones, buffers, COW copies)
                "peak_save_async_children_uss_MiB": r["async"]["peak"]["children_uss"] / MiB,
                "peak_save_children_uss_MiB": r["warm"]["peak"]["children_uss"] / MiB,
                "save_async_increase_vs_state": (r["async"]["peak"]["self"] - r["async"]["rss_before"]) / state,
                "peak_save_children_MiB": max(r["warm"]["peak"]["children"], r["cold"]["peak"]["children"]) / MiB,
                "peak_load_MiB": r["peak_load"]["self"] / MiB,
                "peak_hf_parallel_MiB": r["peak_hf_parallel"]["self"] / MiB,
                "peak_hf_mbridge_MiB": r["peak_hf_mbridge"]["self"] / MiB,
                # the save's peak above what the bare runtime (torch, megatron, gloo) held before the model existed
                "peak_save_over_runtime_vs_state": (peak - r["rss_runtime"]) / state,
                "peak_save_vs_state": peak / state,
                # what the save itself added on top of the trained actor
                "save_increase_vs_state": (peak - r["warm"]["rss_before"]) / state,
            }
        )
    return {
        "world": world,
        "layout": dict(zip(("tp", "pp", "ep", "etp"), LAYOUTS[world], strict=True)),
        "wall_s": wall,
        "build_and_train_s": r0["build_and_train_s"],
        "cold": _save_summary(r0["cold"]),
        "warm": _save_summary(r0["warm"]),
        "async": _async_summary(ranks, "async"),
        "async_background_write": _async_summary(ranks, "async_background_write"),
        "load_s": r0["load_s"],
        "hf_parallel_s": r0["hf_parallel_s"],
        "hf_mbridge_s": r0["hf_mbridge_s"],
        "hf_identical_to_mbridge": r0["hf_identical"],
        "per_rank": per_rank,
    }


def evaluate(results: dict, disk: dict) -> dict:
    """Each target against the warm save (what every save after a run's first costs)."""
    checks = {}
    for key, layout in results["layouts"].items():
        warm = layout["warm"]
        verify = warm["phases_s"]["hf_verify"]
        worst = max(r["peak_save_over_runtime_vs_state"] for r in layout["per_rank"])
        checks[f"{key}: dist-ckpt save throughput / disk write bandwidth"] = (
            warm["dist_ckpt_Bps"] / disk["fsync_Bps"],
            ">=",
            TARGETS["dist_ckpt_vs_disk"],
        )
        if "serialization" in results:
            checks[f"{key}: dist-ckpt save throughput / one process's torch.save + fsync (not a target)"] = (
                warm["dist_ckpt_Bps"] / results["serialization"]["torch_save_fsync_Bps"],
                ">=",
                None,
            )
        checks[f"{key}: HF export time, mbridge save_weights / parallel"] = (
            layout["hf_mbridge_s"] / layout["hf_parallel_s"],
            ">=",
            TARGETS["hf_export_speedup_8ranks"] if layout["world"] == 8 else None,
        )
        checks[f"{key}: verification / rest of the save"] = (
            verify / (warm["save_s"] - verify),
            "<=",
            TARGETS["verify_share_of_save"],
        )
        for mode in ("async", "async_background_write"):
            checks[f"{key}: async save ({layout[mode]['mode']}), training blocked / sync save"] = (
                layout[mode]["blocked_s"] / warm["save_s"],
                "<=",
                TARGETS["async_blocked_vs_sync"],
            )
        checks[f"{key}: load / save"] = (layout["load_s"] / warm["save_s"], "<=", TARGETS["load_vs_save"])
        checks[f"{key}: peak RSS during save above the runtime / state (worst rank)"] = (
            worst,
            "<=",
            TARGETS["peak_rss_vs_state"],
        )
        checks[f"{key}: (peak RSS during save - RSS before it) / state (worst rank; not a target)"] = (
            max(r["save_increase_vs_state"] for r in layout["per_rank"]),
            "<=",
            None,
        )
        checks[f"{key}: peak RSS during save / state (worst rank, runtime included)"] = (
            max(r["peak_save_vs_state"] for r in layout["per_rank"]),
            "<=",
            TARGETS["peak_rss_vs_state"],
        )
    return {
        name: {
            "value": value,
            "op": op,
            "target": target,
            "met": None if target is None else (value >= target if op == ">=" else value <= target),
        }
        for name, (value, op, target) in checks.items()
    }


def print_report(results: dict) -> None:
    """The results as markdown tables (docs/perf.md shows them)."""
    disk, keys = results["disk"], list(results["layouts"])
    layouts = [results["layouts"][k] for k in keys]
    print(
        f"\nmodel: {results['params'] / 1e6:.1f}M params (fp32); disk write+fsync {disk['fsync_Bps'] / MiB:.0f} MiB/s "
        f"(buffered {disk['buffered_Bps'] / MiB:.0f} MiB/s); one process torch.save + fsync "
        f"{results['serialization']['torch_save_fsync_Bps'] / MiB:.0f} MiB/s; load average {results['machine']['loadavg']}\n"
    )

    def row(label: str, fn) -> None:
        print(f"| {label} | " + " | ".join(fn(layout) for layout in layouts) + " |")

    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for save in ("cold", "warm"):
        row(f"save ({save}), total s", lambda x, s=save: f"{x[s]['save_s']:.2f}")
        for phase in ("finite_check", "staging", "dist_checkpoints", "hf_config", "hf_weights", "metadata", "hf_verify", "commit", "other"):
            row(f"&nbsp;&nbsp;{phase}", lambda x, s=save, p=phase: f"{x[s]['phases_s'].get(p, 0.0):.2f}")
        row(f"&nbsp;&nbsp;dist-ckpt MiB/s ({save})", lambda x, s=save: f"{x[s]['dist_ckpt_Bps'] / MiB:.0f}")
    for mode in ("async", "async_background_write"):
        row(f"async save ({layouts[0][mode]['mode']}): training blocked, s", lambda x, m=mode: f"{x[m]['blocked_s']:.2f}")
        row("&nbsp;&nbsp;/ warm sync save", lambda x, m=mode: f"{x[m]['blocked_s'] / x['warm']['save_s']:.1%}")
        for phase in (*BLOCKING_PHASES, "other"):
            row(f"&nbsp;&nbsp;of it: {phase}", lambda x, m=mode, p=phase: f"{x[m]['blocked_by_phase_s'][p]:.2f}")
        row("&nbsp;&nbsp;background part until committed (finalize called at once), s", lambda x, m=mode: f"{x[m]['finalize_s']:.2f}")
    row("load (model + optimizer + extra), s", lambda x: f"{x['load_s']:.2f}")
    row("HF export, parallel save_weights, s", lambda x: f"{x['hf_parallel_s']:.2f}")
    row("HF export, mbridge save_weights, s", lambda x: f"{x['hf_mbridge_s']:.2f}")
    row("files identical to mbridge's", lambda x: str(x["hf_identical_to_mbridge"]))
    for part in ("model_dist_ckpt", "optimizer_dist_ckpt", "extra_dist_ckpt", "huggingface", "total"):
        row(f"bytes written: {part}, MiB", lambda x, p=part: f"{x['warm']['bytes'][p] / MiB:.1f}")
    row("state per rank (params+grads+Adam), MiB", lambda x: "/".join(f"{r['state_MiB']:.0f}" for r in x["per_rank"]))
    row(
        "RSS of the bare runtime per rank, MiB",
        lambda x: "/".join(f"{r['rss_runtime_MiB']:.0f}" for r in x["per_rank"]),
    )
    row(
        "RSS before the save per rank, MiB",
        lambda x: "/".join(f"{r['rss_before_save_MiB']:.0f}" for r in x["per_rank"]),
    )
    row("peak RSS during save per rank, MiB", lambda x: "/".join(f"{r['peak_save_MiB']:.0f}" for r in x["per_rank"]))
    row("peak RSS during async save per rank, MiB", lambda x: "/".join(f"{r['peak_save_async_MiB']:.0f}" for r in x["per_rank"]))
    row("peak RSS during load per rank, MiB", lambda x: "/".join(f"{r['peak_load_MiB']:.0f}" for r in x["per_rank"]))
    row(
        "peak RSS, parallel HF export, MiB",
        lambda x: "/".join(f"{r['peak_hf_parallel_MiB']:.0f}" for r in x["per_rank"]),
    )
    row(
        "peak RSS, mbridge HF export, MiB", lambda x: "/".join(f"{r['peak_hf_mbridge_MiB']:.0f}" for r in x["per_rank"])
    )
    row(
        "writer child processes, peak RSS, MiB",
        lambda x: f"{max(r['peak_save_children_MiB'] for r in x['per_rank']):.0f}",
    )
    row(
        "forked processes' own memory (USS), sync / async save, worst rank, MiB",
        lambda x: f"{max(r['peak_save_children_uss_MiB'] for r in x['per_rank']):.0f} / "
        f"{max(r['peak_save_async_children_uss_MiB'] for r in x['per_rank']):.0f}",
    )
    row(
        "async save: peak RSS - RSS before, / state, worst rank",
        lambda x: f"{max(r['save_async_increase_vs_state'] for r in x['per_rank']):.2f}",
    )
    print("\n| target | value | met |\n|---|---|---|")
    for name, check in results["targets"].items():
        verdict = "n/a" if check["met"] is None else ("yes" if check["met"] else "**no**")
        target = "" if check["target"] is None else f" (target {check['op']} {check['target']})"
        print(f"| {name}{target} | {check['value']:.3f} | {verdict} |")


def plot_save_times(results: dict, png_path: str) -> str:
    """Where the time of a warm save goes, per layout: the sync save by phase, and what an async save
    blocks training for next to what it leaves to the background; horizontal stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ("finite_check", "dist_checkpoints", "hf_weights", "hf_verify", "commit", "other")
    colors = ("#937860", "#4c72b0", "#dd8452", "#55a868", "#8172b3", "#999999")
    layouts = list(results["layouts"].items())
    fig, axes = plt.subplots(len(layouts), 1, figsize=(8, 1.9 * len(layouts) + 0.6), dpi=100, squeeze=False)
    for ax, (name, layout) in zip(axes[:, 0], layouts, strict=True):
        left = 0.0
        for phase, color in zip(phases, colors, strict=True):
            width = layout["warm"]["phases_s"].get(phase, 0.0)
            ax.barh("sync save", width, left=left, color=color, label=phase)
            left += width
        blocked, background = layout["async"]["blocked_s"], layout["async"]["finalize_s"]
        ax.barh("async save", blocked, color="#c44e52", label="async: training blocked")
        ax.barh("async save", background, left=blocked, color="#c44e52", alpha=0.25, label="async: in the background")
        ax.text(blocked + background, 1, f"  blocked {blocked:.2f} s ({blocked / layout['warm']['save_s']:.1%} of sync)", va="center")
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_xlim(0, max(left, blocked + background) * 1.6)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds (warm save, %.0fM params)" % (results["params"] / 1e6))
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=150e6, help="model size in parameters (default 150e6)")
    parser.add_argument("--layouts", default="8,1", help="world sizes to run, from 8 (TP2 PP2 EP2 ETP2), 4 (PP2 EP2) and 1")
    parser.add_argument("--out", default="outputs/bench_checkpoint.json")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir under outputs/)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per layout, seconds")
    parser.add_argument("--plot", default=None, help="also write a PNG of where a save's time goes")
    parser.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot from an earlier run's JSON")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as handle:
            print(f"wrote {plot_save_times(json.load(handle), args.plot or 'save_times.png')}")
        return 0

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_", dir=os.path.dirname(os.path.abspath(args.out)))
    os.makedirs(base, exist_ok=True)
    started = time.monotonic()
    try:
        disk = disk_write_bandwidth(base)
        model_path, params = make_model(os.path.join(base, "hf_source"), args.params)
        print(
            f"model: {params / 1e6:.1f}M params at {model_path}; disk {disk['fsync_Bps'] / MiB:.0f} MiB/s (write+fsync)",
            flush=True,
        )
        results = {
            "params": params,
            "overrides": model_overrides(args.params),
            "disk": disk,
            "machine": machine(),
            "layouts": {},
        }
        for world in (int(w) for w in args.layouts.split(",")):
            key = f"{world}rank" + {8: "s TP2 PP2 EP2 ETP2", 4: "s PP2 EP2"}.get(world, "")
            results["layouts"][key] = run_layout(world, model_path, os.path.join(base, f"work{world}"), args.timeout)
        results["disk_after"] = disk_write_bandwidth(base)
        results["serialization"] = serialization_bandwidth(base)
        results["machine_after"] = machine()
        # the better of the two measurements: the stricter reference for the dist-ckpt target
        best = max(disk, results["disk_after"], key=lambda d: d["fsync_Bps"])
        results["targets"] = evaluate(results, best)
        results["wall_s"] = time.monotonic() - started
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    print_report(results)
    if args.plot:
        print(f"wrote {plot_save_times(results, args.plot)}")
    print(f"\nwrote {args.out} ({results['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
