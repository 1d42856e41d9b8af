#!/usr/bin/env python
"""A sync save against the plainest write of the same bytes, in the same process and run: the honest ratio.

One rank builds the actor of ``benchmarks/bench_vs_verl091.py`` (its 60M Qwen3-MoE from
``benchmarks.common.make_model``, ``use_distributed_optimizer=False``, Adam stepped once on seeded gradients) and
clones its parameters and Adam moments into a dict of tensors: the *plain write* is
``safetensors.torch.save_file`` of that dict, padded to the size of our step, then ``fsync`` -- the same bytes
and contents as our save, with no planning, checksums, verification or commit. Then ``--pairs`` interleaved
pairs (ours then plain, plain then ours, ...), the step removed and the page cache synced between any two
writes (untimed). Before the first pair one plain write, untimed, pre-touches the file system (a VM's first
large write after a pause runs at a fraction of the disk: that effect is kept out of both sides).

Reported per run: each pair's ratio (ours / plain) with min / median / max; the **gating statistic**, the median
of the per-pair ratios of the warm pairs (from the 4th); the process's first three saves against the plain
writes of their pairs (sum over sum); anonymous and file-backed RSS (``/proc/self/status`` RssAnon / RssFile,
sampled every 5 ms during our save) as the rise over the value before the save, beside the state's bytes; the
load average before and after each pair. Each run starts in a fresh process once the 1-minute load average is
below ``--max-load`` (it waits up to ``--load-wait-s``, and says so when it gave up). Targets are reported,
never enforced: warm ratio <= 1.4x, first three <= 1.8x, anonymous rise <= 0.1x of the state.

Usage (this repository's venv)::

    .venv/bin/python -m benchmarks.bench_save_vs_plain                      # 2 runs of 10 pairs, ~4 min here
    .venv/bin/python -m benchmarks.bench_save_vs_plain --runs 1 --pairs 4 --params 10e6   # a quick try
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time

from benchmarks.common import MiB, engine, make_model, optim_overrides, prime_optimizer, state_bytes, tree_bytes
from interop import verl091_interop as interop  # standard library only at import

TARGETS = {"warm_ratio": 1.4, "first_three_ratio": 1.8, "anon_rise_over_state": 0.1}
FIRST = 3  # a process's first saves, reported apart (an embedded job makes exactly three)


def _status_bytes() -> dict[str, int]:
    with open("/proc/self/status") as handle:
        text = handle.read()
    return {field: int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024 for field in ("RssAnon", "RssFile")}


class RssSampler:
    """Peak RssAnon and RssFile of this process while running, sampled every 5 ms."""

    def __init__(self) -> None:
        self.before = _status_bytes()
        self.peak = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for field, value in _status_bytes().items():
                self.peak[field] = max(self.peak[field], value)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        after = _status_bytes()
        return {f"{f}_{k}": v for f in self.before for k, v in (("before", self.before[f]), ("peak", self.peak[f]), ("after", after[f]))}


def _plain_write(payload: dict, path: str) -> float:
    from safetensors.torch import save_file

    start = time.monotonic()
    save_file(payload, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.monotonic() - start


def _clean(path: str) -> None:
    """Untimed, between writes: the last write's files go and the page cache is written back."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    os.sync()


def _payload(actor, nbytes: int) -> dict:
    """The actor's parameters and Adam moments, cloned (safetensors refuses tensors sharing a buffer), padded
    with zeros to ``nbytes``: what our step holds, as one plain file."""
    import torch

    tensors = {}
    for c, chunk in enumerate(actor.model):
        for name, param in chunk.named_parameters():
            tensors[f"model{c}.{name}"] = param.detach().clone()
    for s, sub in enumerate(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])):
        inner = getattr(sub, "optimizer", sub)
        for i, values in enumerate(inner.state.values()):
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    tensors[f"optim{s}.{i}.{key}"] = value.detach().clone()
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    if nbytes > held:
        tensors["padding"] = torch.zeros((nbytes - held) // 4, dtype=torch.float32)
    return tensors


def rank_main(model_path: str, work: str, pairs: int) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    actor = engine(model_path, "megatron.dtype=float32", *optim_overrides(interop.OPTIM))
    prime_optimizer(actor.model, actor.optimizer, actor.scheduler, interop.SEED)
    state = state_bytes(actor)
    plain_path = os.path.join(work, "plain.safetensors")
    probe = _payload(actor, 0)
    pretouch_s = _plain_write(probe, plain_path)  # untimed pre-touch of the file system, both sides after it
    _clean(plain_path)
    del probe
    payload = None
    out: dict = {"state": state, "pretouch_plain_s": pretouch_s, "pairs": []}
    for index in range(pairs):
        step_dir = os.path.join(work, f"global_step_{index + 1}", "actor")
        order = ("ours", "plain") if index % 2 == 0 else ("plain", "ours")
        if payload is None and order[0] == "plain":
            order = ("ours", "plain")  # the plain file's size is our first step's
        pair: dict = {"order": list(order), "load_before": os.getloadavg()[0]}
        for side in order:
            gc.collect()
            if side == "ours":
                sampler = RssSampler()
                start = time.monotonic()
                actor.save_checkpoint(step_dir, global_step=index + 1)
                pair["ours_s"] = time.monotonic() - start
                pair["rss"] = sampler.stop()
                pair["phases_s"] = dict(actor.last_committed.phase_seconds)
                pair["step_bytes"] = tree_bytes(os.path.dirname(step_dir))
                if payload is None:
                    payload = _payload(actor, pair["step_bytes"])
                    out["plain_bytes"] = sum(t.numel() * t.element_size() for t in payload.values())
                _clean(os.path.dirname(step_dir))
            else:
                pair["plain_s"] = _plain_write(payload, plain_path)
                _clean(plain_path)
        pair["ratio"] = pair["ours_s"] / pair["plain_s"]
        pair["load_after"] = os.getloadavg()[0]
        out["pairs"].append(pair)
        print(f"pair {index + 1}: ours {pair['ours_s']:.3f}s plain {pair['plain_s']:.3f}s ratio {pair['ratio']:.2f} load {pair['load_after']:.1f}", flush=True)
    return out


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def summarize(run: dict) -> dict:
    pairs = run["pairs"]
    warm = pairs[FIRST:]
    first = pairs[:FIRST]
    state = run["state"]["total"]
    anon_rise = [p["rss"]["RssAnon_peak"] - p["rss"]["RssAnon_before"] for p in pairs]
    file_rise = [p["rss"]["RssFile_peak"] - p["rss"]["RssFile_before"] for p in pairs]
    phases = sorted({k for p in warm for k in p["phases_s"]})
    out = {
        "warm_ratio": _spread([p["ratio"] for p in warm]),
        "warm_ours_s": _spread([p["ours_s"] for p in warm]),
        "warm_plain_s": _spread([p["plain_s"] for p in warm]),
        "first_three_ours_s": [p["ours_s"] for p in first],
        "first_three_plain_s": [p["plain_s"] for p in first],
        "first_three_ratio": sum(p["ours_s"] for p in first) / sum(p["plain_s"] for p in first),
        "anon_rise_over_state": max(anon_rise) / state,
        "anon_rise_MiB": _spread([x / MiB for x in anon_rise]),
        "file_rise_MiB": _spread([x / MiB for x in file_rise]),
        "state_MiB": state / MiB,
        "step_MiB": pairs[0]["step_bytes"] / MiB,
        "plain_MiB": run["plain_bytes"] / MiB,
        "pretouch_plain_s": run["pretouch_plain_s"],
        "load": _spread([x for p in pairs for x in (p["load_before"], p["load_after"])]),
        "warm_phases_median_s": {k: statistics.median(p["phases_s"].get(k, 0.0) for p in warm) for k in phases},
    }
    out["met"] = {
        "warm_ratio": out["warm_ratio"]["median"] <= TARGETS["warm_ratio"],
        "first_three_ratio": out["first_three_ratio"] <= TARGETS["first_three_ratio"],
        "anon_rise_over_state": out["anon_rise_over_state"] <= TARGETS["anon_rise_over_state"],
    }
    return out


def wait_for_load(max_load: float, wait_s: float) -> dict:
    start = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - start < wait_s:
        time.sleep(10)
    load = os.getloadavg()[0]
    return {"load_at_start": load, "waited_s": time.monotonic() - start, "below_max": load < max_load}


def markdown(runs: list[dict]) -> str:
    def f(spread: dict, unit: str = "") -> str:
        return f"{spread['median']:.2f}{unit} ({spread['min']:.2f}-{spread['max']:.2f})"

    lines = ["| | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |", "|---|" + "---|" * len(runs)]

    def row(label: str, fn) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in runs) + " |")

    row("**warm save / plain write**, median of per-pair ratios (min-max)", lambda r: f"**{f(r['summary']['warm_ratio'], 'x')}**")
    row("&nbsp;&nbsp;pairs (warm)", lambda r: str(r["summary"]["warm_ratio"]["n"]))
    row("warm save, s", lambda r: f(r["summary"]["warm_ours_s"]))
    row("plain write of the same bytes, s", lambda r: f(r["summary"]["warm_plain_s"]))
    row("first three saves, s", lambda r: " / ".join(f"{x:.2f}" for x in r["summary"]["first_three_ours_s"]))
    row("&nbsp;&nbsp;their pairs' plain writes, s", lambda r: " / ".join(f"{x:.2f}" for x in r["summary"]["first_three_plain_s"]))
    row("**first three / plain**, sum over sum", lambda r: f"**{r['summary']['first_three_ratio']:.2f}x**")
    row("anonymous RSS rise during a save, MiB (max / state)", lambda r: f"{f(r['summary']['anon_rise_MiB'])} ({r['summary']['anon_rise_over_state']:.3f}x)")
    row("file-backed RSS rise during a save, MiB", lambda r: f(r["summary"]["file_rise_MiB"]))
    row("state (params, grads, Adam) / step / plain file, MiB", lambda r: f"{r['summary']['state_MiB']:.0f} / {r['summary']['step_MiB']:.0f} / {r['summary']['plain_MiB']:.0f}")
    row("pre-touch plain write (untimed, before pair 1), s", lambda r: f"{r['summary']['pretouch_plain_s']:.2f}")
    row("load average (1 min) around the pairs", lambda r: f(r["summary"]["load"]))
    phases = sorted({k for r in runs for k in r["summary"]["warm_phases_median_s"]})
    for phase in phases:
        row(f"&nbsp;&nbsp;warm phase `{phase}`, median s", lambda r, p=phase: f"{r['summary']['warm_phases_median_s'].get(p, 0.0):.3f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=10, help="pairs per run; the first three are the cold ones")
    parser.add_argument("--params", type=float, default=61e6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--max-load", type=float, default=4.0)
    parser.add_argument("--load-wait-s", type=float, default=900.0)
    parser.add_argument("--out", default="outputs/bench_save_vs_plain.json")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    if args.pairs < FIRST + 1:
        parser.error(f"--pairs {args.pairs}: at least {FIRST + 1} (the first {FIRST} are reported apart); pass --pairs 10")

    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_save_vs_plain_", dir=out_dir))
    results: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "runs": []}
    try:
        model, params = make_model(os.path.join(base, "hf_source"), args.params, args.experts)
        results.update(params=params, cpus=os.cpu_count())
        for index in range(args.runs):
            start = wait_for_load(args.max_load, args.load_wait_s)
            print(f"run {index + 1}: load {start['load_at_start']:.2f} after waiting {start['waited_s']:.0f}s", flush=True)
            work = os.path.join(base, f"run{index + 1}")
            os.makedirs(work)
            run = run_on_ranks(rank_main, 1, ParallelSizes(), args=(model, work, args.pairs), timeout_s=1800)[0]
            run["start"] = start
            run["summary"] = summarize(run)
            results["runs"].append(run)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"\nmodel {results['params'] / 1e6:.1f}M params, 1 rank; {results['date']}\n")
    print(markdown(results["runs"]))
    print(json.dumps([{"start": r["start"], **r["summary"]} for r in results["runs"]], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
