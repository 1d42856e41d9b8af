"""Does the default run learn for every seed? Run the main job once per ``data.seed`` and tabulate it.

    .venv/bin/python -m benchmarks.five_seeds --out-dir /tmp/five_seeds [--seeds 1,2,3,4,5] [--rollout hf|vllm] [hydra overrides ...]

Each seed is one ``python -m verl.trainer.main_ppo actor_rollout_ref.actor.megatron.vanilla_mbridge=True data.seed=S``
(the defaults but the bridge: mbridge, as on requirements.txt's stack; checkpoints included) in
``<out-dir>/seed_S``, one after the other. ``--rollout`` names the rollout (default: none named, so each run takes
its own default, vllm where ``import vllm`` works, hf otherwise). Written to ``<out-dir>``: ``five_seeds.json``
(per seed: the rollout the run took (its start line), mean reward of the first and last 10 steps, the first step
whose trailing 10-step mean reaches 0.9, steps with grad norm 0, median seconds per step and of its phases
(``gen``, ``update_weights``: the weight sync, ``old_log_prob``, ``update_actor``), seconds spent in steps, wall
seconds from start to exit, the machine's load average while it ran, the peak RSS of each rank and of the
driver), ``five_seeds.md`` (the same as a markdown table) and ``five_seeds.png`` (every seed's reward curve).
The constant-answer baseline is what the best single answer, given to every prompt, would score.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections import Counter

from benchmarks.common import MiB, run_main_job

REWARD_KEY = "critic/score/mean"
WINDOW = 10
TARGET = 0.9
ROLLOUT_KEY = "actor_rollout_ref.rollout.name"
PHASES = ("gen", "update_weights", "old_log_prob", "update_actor")  # timing_s/<phase>: the step's split


def constant_answer_baseline(seed: int, max_operand: int, task: str) -> float:
    """The mean reward of the best prompt-independent policy: one answer for every prompt of the task."""
    from verl.utils.dataset.arithmetic import make_arithmetic_dataset

    answers = Counter(row["ground_truth"] for row in make_arithmetic_dataset(seed, max_operand=max_operand, task=task))
    return max(answers.values()) / sum(answers.values())


def rollout_taken(log_text: str) -> str | None:
    """The rollout a run took, from its start line (``[main_ppo] rollout: <name> ...``); None: no such line."""
    found = re.search(r"^\[main_ppo\] rollout: (\w+)", log_text, re.MULTILINE)
    return found.group(1) if found else None


def summarize_seed(seed: int, records: list[dict], wall_s: float, load: list[float], rollout: str | None = None, rank_rss: dict | None = None) -> dict:
    """The table row of one run, from its metrics.jsonl records, the rollout it took and its peak RSS per rank
    (``run_main_job``'s ``rank_rss``: rank -> bytes, and ``"driver"``)."""
    rewards = [r[REWARD_KEY] for r in records]
    rss = {str(rank): round(peak / MiB) for rank, peak in (rank_rss or {}).items()}
    trailing = [statistics.fmean(rewards[i - WINDOW : i]) for i in range(WINDOW, len(rewards) + 1)]
    reached = next((records[i + WINDOW - 1]["step"] for i, mean in enumerate(trailing) if mean >= TARGET), None)
    return {
        "seed": seed,
        "steps": len(records),
        "reward_first10": round(statistics.fmean(rewards[:WINDOW]), 3),
        "reward_last10": round(statistics.fmean(rewards[-WINDOW:]), 3),
        "first_step_trailing10_ge_0.9": reached,
        "steps_grad_norm_0": sum(1 for r in records if r.get("actor/grad_norm", 1.0) == 0.0),
        "rollout": rollout,
        "median_step_s": round(statistics.median(r["timing_s/step"] for r in records), 2),
        **{f"median_{phase}_s": round(statistics.median(r.get(f"timing_s/{phase}", float("nan")) for r in records), 3) for phase in PHASES},
        "peak_rss_mib": rss,
        "steps_s": round(sum(r["timing_s/step"] for r in records), 1),
        "wall_s": round(wall_s, 1),
        "load_avg_min": round(min(load), 1),
        "load_avg_median": round(statistics.median(load), 1),
        "load_avg_max": round(max(load), 1),
        "rewards": rewards,
    }


def run_seed(seed: int, out_dir: str, overrides: list[str]) -> dict:
    """One run of the main job with ``data.seed=seed`` in a fresh ``<out_dir>/seed_<seed>``."""
    run_dir, rank_rss = os.path.join(out_dir, f"seed_{seed}"), {}
    records, wall_s, load = run_main_job(run_dir, [f"data.seed={seed}", *overrides], f"five_seeds seed {seed}", rank_rss=rank_rss)
    with open(os.path.join(run_dir, "run.log"), errors="replace") as f:
        rollout = rollout_taken(f.read())
    row = summarize_seed(seed, records, wall_s, load, rollout, rank_rss)
    print(f"[five_seeds] seed {seed} ({rollout}): last-10 mean reward {row['reward_last10']}, {row['wall_s']} s, load {row['load_avg_median']}", flush=True)
    return row


def markdown_table(rows: list[dict], baseline: float) -> str:
    lines = [
        "| `data.seed` | rollout | reward, first 10 steps | reward, last 10 steps | first step with 10-step mean >= 0.9 | steps with grad norm 0 | median s/step | median s: gen / sync / old logp / update | s in steps | wall s | load average (median, max) | peak RSS MiB per rank (min-max; driver) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = " / ".join(f"{r[f'median_{phase}_s']:.2f}" for phase in PHASES)
        ranks = [mib for rank, mib in r["peak_rss_mib"].items() if rank != "driver"]
        rss = f"{min(ranks)}-{max(ranks)}; {r['peak_rss_mib'].get('driver')}" if ranks else "-"
        lines.append(
            f"| {r['seed']} | {r['rollout']} | {r['reward_first10']:.3f} | **{r['reward_last10']:.3f}** | {r['first_step_trailing10_ge_0.9']} | "
            f"{r['steps_grad_norm_0']} / {r['steps']} | {r['median_step_s']:.2f} | {split} | {r['steps_s']:.0f} | {r['wall_s']:.0f} | "
            f"{r['load_avg_median']}, {r['load_avg_max']} | {rss} |"
        )
    lines.append(f"\nA constant answer (the best one, given to every prompt) scores {baseline:.3f}.")
    return "\n".join(lines) + "\n"


def plot_curves(rows: list[dict], baseline: float, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for r in rows:
        rewards = r["rewards"]
        trailing = [statistics.fmean(rewards[max(0, i + 1 - WINDOW) : i + 1]) for i in range(len(rewards))]
        ax.plot(range(1, len(rewards) + 1), trailing, linewidth=1.5, label=f"seed {r['seed']} (last 10: {r['reward_last10']:.2f})")
    ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label=f"constant answer ({baseline:.2f})")
    ax.axhline(TARGET, color="black", linestyle=":", linewidth=1, label=f"target {TARGET}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean reward, trailing {WINDOW} steps")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("GRPO mean reward of the default run, one curve per data.seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated data.seed values")
    parser.add_argument("--rollout", choices=("hf", "vllm"), default=None, help="the rollout (default: the run's own, vllm where import vllm works)")
    args, overrides = parser.parse_known_args(argv)
    if args.rollout:
        overrides = [f"{ROLLOUT_KEY}={args.rollout}", *overrides]
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        data = compose(config_name="ppo_megatron_trainer", overrides=overrides).data
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = [run_seed(seed, out_dir, overrides) for seed in seeds]
    baseline = constant_answer_baseline(seeds[0], int(data.max_operand), str(data.task))
    with open(os.path.join(out_dir, "five_seeds.json"), "w") as f:
        json.dump({"overrides": overrides, "rollout": args.rollout, "constant_answer_baseline": baseline, "runs": rows}, f, indent=1)
    table = markdown_table(rows, baseline)
    with open(os.path.join(out_dir, "five_seeds.md"), "w") as f:
        f.write(table)
    plot_curves(rows, baseline, os.path.join(out_dir, "five_seeds.png"))
    print(table, flush=True)
    return 0 if all(r["reward_last10"] >= TARGET for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
