"""A save's fixed cost at the default GRPO job's layout: seconds per save and the collectives each save issues.

Each of 8 ranks (TP2 PP2 EP2 ETP2) builds the actor of the embedded default model (the job's; 4.5 MiB of state)
and saves ``--saves`` tracked steps in a row, keeping two (``max_ckpt_to_keep=2``), through the engine's public
``save_checkpoint``, the sync mode. Reported: each save's seconds on its slowest rank and their median past the
first ``--warmup``; the CPU seconds all ranks spent in a save (process time, every thread), which against the
cores' wall time says whether a save waits for CPU or for its peers, split into the ranks' main threads, their
gloo threads and the rest (the save's own threads: the HF export beside the dist write, the sealing, the
writers); and for saves ``warmup+1 .. warmup+3``, every torch.distributed collective rank 0 issued,
by call site (its innermost three frames in verl or megatron-core), with its count per save and its seconds
per save (the time rank 0 waits there: with 8 processes on few cores, each collective waits until every rank
has been scheduled). A collective inside another (``all_gather_object`` calls ``all_gather``) counts once.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.bench_save_collectives --out outputs/save_collectives.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import threading
import time
import traceback

from benchmarks.common import engine, machine
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

LAYOUT = ParallelSizes(tp=2, pp=2, ep=2, etp=2)
COLLECTIVES = (
    "all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce_scatter_tensor", "scatter_object_list",
)  # fmt: skip
COUNTED_SAVES = 3


def _call_site(name: str) -> str:
    """``name <- f < g < h``: the innermost three frames of verl or megatron-core that led to the collective."""
    frames = [f for f in traceback.extract_stack()[:-2] if ("/verl/" in f.filename or "/megatron/core/" in f.filename) and "c10d" not in f.filename]
    return f"{name} <- " + " < ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in reversed(frames[-3:]))


def saves_rank(model_path: str, root: str, saves: int, warmup: int) -> dict:
    import torch.distributed as dist

    actor = engine(model_path)  # the YAML's layout is the job's, LAYOUT; the ranks' parallel state is already it
    counted: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    counting, inside = threading.Event(), threading.local()

    def counter(name, collective):
        def counted_collective(*args, **kwargs):
            if not counting.is_set() or getattr(inside, "busy", False):
                return collective(*args, **kwargs)
            inside.busy, start = True, time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                inside.busy = False
                entry = counted[_call_site(name)]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        return counted_collective

    if dist.get_rank() == 0:
        for name in COLLECTIVES:
            setattr(dist, name, counter(name, getattr(dist, name)))
    seconds, cpu_seconds, split = [], [], []
    for step in range(1, saves + 1):
        dist.barrier()
        if warmup < step <= warmup + COUNTED_SAVES:
            counting.set()
        start, cpu_start, main_start, gloo_start = time.perf_counter(), time.process_time(), time.thread_time(), _gloo_cpu_seconds()
        actor.save_checkpoint(os.path.join(root, f"global_step_{step}", "actor"), global_step=step, max_ckpt_to_keep=2, track=True)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        main, gloo = time.thread_time() - main_start, _gloo_cpu_seconds() - gloo_start
        split.append({"main_thread": main, "gloo_threads": gloo, "rest": cpu_seconds[-1] - main - gloo})
        counting.clear()
    collectives = {site: [n / COUNTED_SAVES, s / COUNTED_SAVES] for site, (n, s) in counted.items()}
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "cpu_split": split, "collectives": collectives}


def _gloo_cpu_seconds() -> float:
    """CPU seconds so far of this process's gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``: they live as
    long as the process groups), from /proc in clock ticks (10 ms a thread here: a median over saves and a sum
    over ranks smooth it). The rest of a save's CPU is its own threads' (they end with each save) and any other
    long-lived thread's (on a GPU host NCCL's watchdog)."""
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as handle:
                if "gloo" not in handle.read():
                    continue
            with open(f"/proc/self/task/{tid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="first saves left out of the median (and not counted)")
    parser.add_argument("--out", default="outputs/save_collectives.json")
    args = parser.parse_args(argv)
    if args.saves < args.warmup + COUNTED_SAVES:
        parser.error(f"--saves={args.saves} must be at least --warmup + {COUNTED_SAVES}")
    from verl.trainer.main_ppo import embedded_model_path

    with tempfile.TemporaryDirectory(prefix="bench_save_collectives.") as work:
        os.environ["VERL_TINY_MODEL_CACHE"] = os.path.join(work, "model")
        ranks = run_on_ranks(saves_rank, 8, LAYOUT, args=(embedded_model_path(), os.path.join(work, "ckpt"), args.saves, args.warmup), timeout_s=900)
    per_save = [max(rank["seconds"][i] for rank in ranks) for i in range(args.saves)]
    cpu_per_save = [sum(rank["cpu_seconds"][i] for rank in ranks) for i in range(args.saves)]
    sites = sorted(ranks[0]["collectives"].items(), key=lambda item: -item[1][1])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "layout": "TP2 PP2 EP2 ETP2, 8 ranks",
        "save_s": [round(s, 3) for s in per_save],
        "save_s_median_warm": round(statistics.median(per_save[args.warmup :]), 3),
        "cpu_s_all_ranks_median_warm": round(statistics.median(cpu_per_save[args.warmup :]), 3),
        "cpu_s_all_ranks_by_thread_median_warm": {
            kind: round(statistics.median(sum(rank["cpu_split"][i][kind] for rank in ranks) for i in range(args.warmup, args.saves)), 3)
            for kind in ("main_thread", "gloo_threads", "rest")
        },
        "cores": len(os.sched_getaffinity(0)),
        "collectives_per_save": round(sum(n for n, _ in ranks[0]["collectives"].values()), 2),
        "rank0_seconds_in_collectives_per_save": round(sum(s for _, s in ranks[0]["collectives"].values()), 3),
        "by_call_site": {site: {"per_save": round(n, 2), "seconds_per_save": round(s, 4)} for site, (n, s) in sites},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"[bench_save_collectives] save s, median of saves {args.warmup + 1}-{args.saves}: {report['save_s_median_warm']}; "
          f"CPU s of all ranks a save: {report['cpu_s_all_ranks_median_warm']} on {report['cores']} cores "
          f"({', '.join(f'{kind} {s}' for kind, s in report['cpu_s_all_ranks_by_thread_median_warm'].items())}); "
          f"rank 0: {report['collectives_per_save']} collectives a save, {report['rank0_seconds_in_collectives_per_save']} s in them")  # fmt: skip
    for site, row in report["by_call_site"].items():
        print(f"  {row['per_save']:>4} x {row['seconds_per_save']:.4f} s  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
