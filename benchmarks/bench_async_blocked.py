"""Training blocked by an async save against a warm sync save of the same state, in interleaved pairs.

Each rank builds the actor of ``bench_checkpoint`` (fixed Qwen3-MoE, full checkpoint with HF weights), trains
one step, saves three times synchronously (cold, plan validated, warm) and once per async mode (the first async
save starts the writers' results Manager in the rank, once per process), then runs ``--pairs`` pairs: one warm
sync save, one ``background_write`` save (blocked time: the engine's ``save_checkpoint`` between two barriers;
then finalized), one ``snapshot`` save (likewise). Per pair the ratio blocked / sync; reported: the median of
the ratios with their min and max, per mode, and the slowest rank's split of the blocked time (the report's
phases). Nothing is enforced.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.bench_async_blocked --layouts 1,4 --pairs 7 --out outputs/async_blocked.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.bench_checkpoint import LAYOUTS, PeakRSS, _save, _save_async
from benchmarks.common import engine, make_model

MODES = ("background_write", "snapshot")


def pairs_rank(model_path: str, work: str, pairs: int) -> dict:
    import torch

    peak = PeakRSS()
    actor = engine(model_path, "megatron.dtype=float32")
    data = torch.randint(4, 90, (4, 33), generator=torch.Generator().manual_seed(0))
    actor.train_step([data[:2], data[2:]])
    step = 0

    def step_dir() -> str:
        """The next step's directory, the previous steps removed first (a save is finalized before the next)."""
        nonlocal step
        step += 1
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
        torch.distributed.barrier()
        return os.path.join(work, "ckpt", f"global_step_{step}", "actor")

    for _ in range(3):  # cold, validated, warm: the plan is reused from here on
        _save(actor, step_dir(), step, peak)
    for mode in MODES:  # the process's first async saves: its writers' results queue (a Manager) starts in the rank
        _save_async(actor, step_dir(), step, peak, mode)
    out = []
    for _ in range(pairs):
        pair = {"sync_s": _save(actor, step_dir(), step, peak)["save_s"]}
        for mode in MODES:
            saved = _save_async(actor, step_dir(), step, peak, mode)
            pair[mode] = {"blocked_s": saved["blocked_s"], "phases": saved["phases"], "finalize_s": saved["finalize_s"]}
        out.append(pair)
    return {"rank": torch.distributed.get_rank(), "pairs": out}


def summarize(ranks: list[dict]) -> dict:
    """Per pair the slowest rank's times; per mode the median ratio and its spread."""
    count = len(ranks[0]["pairs"])
    pairs = []
    for index in range(count):
        each = [r["pairs"][index] for r in ranks]
        pair = {"sync_s": max(p["sync_s"] for p in each)}
        for mode in MODES:
            pair[mode] = max(p[mode]["blocked_s"] for p in each)
            pair[f"{mode}_phases"] = {k: max(p[mode]["phases"].get(k, 0.0) for p in each) for k in each[0][mode]["phases"]}
        pairs.append(pair)
    summary = {"pairs": pairs, "sync_s_median": statistics.median(p["sync_s"] for p in pairs)}
    for mode in MODES:
        ratios = [p[mode] / p["sync_s"] for p in pairs]
        blocked = [p[mode] for p in pairs]
        summary[mode] = {
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "blocked_s_median": statistics.median(blocked), "blocked_s_min": min(blocked), "blocked_s_max": max(blocked),
        }  # fmt: skip
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=150e6)
    parser.add_argument("--layouts", default="1,4")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--out", default="outputs/async_blocked.json")
    args = parser.parse_args()

    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench_async_", dir=os.path.dirname(os.path.abspath(args.out)))
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_before": os.getloadavg(), "layouts": {}}
    try:
        model_path, params = make_model(os.path.join(base, "hf_source"), args.params)
        results["params"] = params
        for world in (int(w) for w in args.layouts.split(",")):
            ranks = run_on_ranks(pairs_rank, world, ParallelSizes(*LAYOUTS[world]), args=(model_path, os.path.join(base, f"w{world}"), args.pairs), timeout_s=1800)
            results["layouts"][str(world)] = summary = summarize(ranks)
            print(f"{world} rank(s): warm sync {summary['sync_s_median']:.2f} s", flush=True)
            for mode in MODES:
                s = summary[mode]
                print(
                    f"  {mode}: blocked {s['blocked_s_median']:.3f} s ({s['blocked_s_min']:.3f}-{s['blocked_s_max']:.3f}), "
                    f"{100 * s['ratio_median']:.1f}% of sync ({100 * s['ratio_min']:.1f}-{100 * s['ratio_max']:.1f}%)",
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
