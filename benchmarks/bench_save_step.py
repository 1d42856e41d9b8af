"""What a save step costs the main job: the default GRPO run with a save every step against the same run without saves.

    .venv/bin/python -m benchmarks.bench_save_step --out-dir /tmp/save_step [--pairs 7] [--steps 12] [hydra overrides ...]
    .venv/bin/python -m benchmarks.bench_save_step --out-dir /tmp/save_step actor_rollout_ref.rollout.name=hf   # docs/perf.md's runs

The job's rollout is the YAML's default: vLLM where it is installed (its engines on the same 2 cores make a step
about twice as long); docs/perf.md measures the transformers rollout, as its target is set for.

Each pair is two runs of ``python -m verl.trainer.main_ppo`` on the defaults (8 ranks, TP2 PP2 EP2 ETP2, the embedded
model, the YAML's async mode) for ``--steps`` steps: one with ``trainer.save_freq=1``, one with
``trainer.save_freq=0``, their order alternating from pair to pair. The first ``--warmup`` steps of each run are
left out (the first saves set up their writers). From each run's metrics.jsonl:

- ``save_s``: the median of ``timing_s/save_checkpoint``, the time the loop waits in a save;
- ``slowdown_s``: the median ``timing_s/step`` of the saving run minus the other's (writers left running in the
  background compete with the next step for the cores);
- ``added_s = save_s + slowdown_s``: what a save step adds; ``share``: ``added_s`` over the median step of the run
  without saves.

Reported per pair and as the median of the per-pair values with their range, with the load average while the pairs
ran, in ``<out-dir>/save_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common import machine, run_main_job


def pair_row(saving: list[dict], plain: list[dict], warmup: int) -> dict:
    """One pair's numbers from the two runs' records, past the warm-up steps."""
    saving, plain = saving[warmup:], plain[warmup:]
    step_saving = statistics.median(r["timing_s/step"] for r in saving)
    step_plain = statistics.median(r["timing_s/step"] for r in plain)
    save_s = statistics.median(r["timing_s/save_checkpoint"] for r in saving)
    added = save_s + step_saving - step_plain
    return {
        "step_s": round(step_plain, 3),
        "step_s_saving": round(step_saving, 3),
        "save_s": round(save_s, 3),
        "slowdown_s": round(step_saving - step_plain, 3),
        "added_s": round(added, 3),
        "share": round(added / step_plain, 3),
    }


def spread(rows: list[dict], key: str) -> dict:
    values = [row[key] for row in rows]
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    args, overrides = parser.parse_known_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps={args.steps} leaves no step after --warmup={args.warmup}; raise --steps")
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    rows, load = [], []
    for pair in range(args.pairs):
        runs = {}
        for label, save_freq in (("saving", 1), ("plain", 0))[:: 1 if pair % 2 == 0 else -1]:
            command = [f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={save_freq}", "trainer.resume_mode=disable", *overrides]
            runs[label], wall_s, samples = run_main_job(os.path.join(out_dir, f"pair{pair + 1}_{label}"), command, f"bench_save_step pair {pair + 1} {label}")
            load += samples
            print(f"[bench_save_step] pair {pair + 1} {label}: {wall_s:.0f} s", flush=True)
        rows.append(pair_row(runs["saving"], runs["plain"], args.warmup))
        print(f"[bench_save_step] pair {pair + 1}: {rows[-1]}", flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "overrides": overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs": rows,
        "summary": {key: spread(rows, key) for key in ("step_s", "save_s", "slowdown_s", "added_s", "share")},
        "load_avg": {"min": round(min(load), 1), "median": round(statistics.median(load), 1), "max": round(max(load), 1)},
    }
    with open(os.path.join(out_dir, "save_step.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
