"""Peak host RSS per rank while offloading a Megatron model (and its optimizer) to host memory.

Builds a Qwen3-MoE through the bridge (fp32; larger than the test model so the numbers are not
allocator noise), trains one step so grads and Adam states exist, then on every rank:

1. baseline = RSS after a gc; reset the peak (``/proc/self/clear_refs`` <- 5, falling back to a
   sampling thread where that is not allowed);
2. ``offload_megatron_model_to_cpu``; peak above baseline vs. the rank's param + grad bytes;
3. the same for ``offload_megatron_optimizer`` vs. the rank's optimizer-state bytes;
4. reload both, offload again (the host copies of the first offload are reused) and measure again.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.bench_offload_rss                       # 1 rank and TP2 PP2 EP2 ETP2 (8 ranks), DO off/on
    .venv/bin/python -m benchmarks.bench_offload_rss --world 1 --do 0      # one configuration
    .venv/bin/python -m benchmarks.bench_offload_rss --world 16 --tp 2 --pp 4 --ep 2 --etp 2 --do 0

The target (docs/offload.md): peak RSS above baseline during the model offload <= 1.1x the rank's
param + grad bytes. The script exits non-zero when a rank misses it.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import threading
import time

import torch

TARGET = 1.1
MiB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE).group(1))


def _rss() -> int:
    return _status_kib("VmRSS") * 1024


class _PeakRSS:
    """Peak RSS of this process between start() and stop(): the kernel's high-water mark, reset
    through clear_refs, or, where that is refused, a 1 ms sampling thread."""

    def __init__(self) -> None:
        self._peak = 0
        self._running = False
        self._thread: threading.Thread | None = None
        self.method = "VmHWM"

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampling"
            self._peak, self._running = _rss(), True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, _rss())
            time.sleep(0.001)

    def stop(self) -> int:
        if self.method == "VmHWM":
            return _status_kib("VmHWM") * 1024
        self._running = False
        self._thread.join()
        return max(self._peak, _rss())


def _bench_config(hidden_size: int):
    from verl.models.tiny import tiny_hf_config

    config = tiny_hf_config("moe")
    config.hidden_size = hidden_size
    config.intermediate_size = 2 * hidden_size
    config.moe_intermediate_size = hidden_size
    config.num_attention_heads = 8
    config.num_key_value_heads = 4
    config.head_dim = hidden_size // 8
    return config


def _measure(use_distributed_optimizer: bool, hidden_size: int) -> dict:
    """Runs on every rank."""
    from verl.models.mcore import make_bridge
    from verl.models.mcore.forward import train_step
    from verl.models.mcore.model import build_megatron_model
    from verl.utils import megatron_utils
    from verl.utils.megatron.optimizer import get_megatron_optimizer_and_scheduler

    bridge = make_bridge(_bench_config(hidden_size), dtype=torch.float32)
    model = build_megatron_model(bridge, use_distributed_optimizer=use_distributed_optimizer)
    optimizer, scheduler = get_megatron_optimizer_and_scheduler(
        model, use_distributed_optimizer=use_distributed_optimizer
    )
    data = torch.randint(4, 90, (2, 33), generator=torch.Generator().manual_seed(0))
    train_step(model, optimizer, scheduler, [data])

    storages = megatron_utils.describe_megatron_storages(model, optimizer)
    param_bytes, grad_bytes, state_bytes = (sum(r.nbytes for r in storages if r.kind == kind) for kind in ("param", "grad", "optimizer"))
    peak = _PeakRSS()
    result = {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "state_bytes": state_bytes}
    for cycle in ("first", "second"):
        gc.collect()
        baseline = _rss()
        peak.start()
        megatron_utils.offload_megatron_model_to_cpu(model)
        result[f"{cycle}_model_peak"] = peak.stop() - baseline
        result[f"{cycle}_model_after"] = _rss() - baseline
        gc.collect()
        baseline_opt = _rss()
        peak.start()
        megatron_utils.offload_megatron_optimizer(optimizer)
        result[f"{cycle}_opt_peak"] = peak.stop() - baseline_opt
        assert megatron_utils.is_megatron_module_offloaded(model)
        megatron_utils.load_megatron_model_to_gpu(model)
        megatron_utils.load_megatron_optimizer(optimizer)
    result["method"] = peak.method
    train_step(model, optimizer, scheduler, [data])  # still trains after two cycles
    return result


def _row(label: str, rank: int, r: dict) -> str:
    pg = r["param_bytes"] + r["grad_bytes"]
    return (
        f"| {label} | {rank} | {r['param_bytes'] / MiB:.1f} | {r['grad_bytes'] / MiB:.1f} "
        f"| {r['first_model_peak'] / MiB:.1f} ({r['first_model_peak'] / pg:.2f}x) "
        f"| {r['second_model_peak'] / MiB:.1f} ({r['second_model_peak'] / pg:.2f}x) "
        f"| {r['state_bytes'] / MiB:.1f} | {r['first_opt_peak'] / MiB:.1f} | {r['second_opt_peak'] / MiB:.1f} |"
    )


def main() -> int:
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, help="ranks; default: 1 rank, then TP2 PP2 EP2 ETP2 on 8 ranks")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--do", choices=["0", "1", "both"], default="both", help="use_distributed_optimizer")
    parser.add_argument("--hidden-size", type=int, default=512)
    args = parser.parse_args()

    if args.world is None:
        layouts = [(1, ParallelSizes()), (8, ParallelSizes(tp=2, pp=2, ep=2, etp=2))]
    else:
        layouts = [(args.world, ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp))]
    modes = [False, True] if args.do == "both" else [args.do == "1"]

    print(
        "| layout, DO | rank | params MiB | grads MiB | model offload peak above baseline, 1st (x param+grad) "
        "| 2nd | Adam states MiB | optimizer offload peak, 1st | 2nd |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for world, sizes in layouts:
        for use_do in modes:
            start = time.monotonic()
            results = run_on_ranks(_measure, world, sizes, args=(use_do, args.hidden_size), timeout_s=1800)
            label = f"{world} rank(s) TP{sizes.tp} PP{sizes.pp} EP{sizes.ep} ETP{sizes.expert_tp}, DO={use_do}"
            for rank, result in enumerate(results):
                print(_row(label, rank, result))
                worst = max(worst, result["first_model_peak"] / (result["param_bytes"] + result["grad_bytes"]))
            print(
                f"<!-- {label}: {time.monotonic() - start:.0f} s, peak by {results[0]['method']} -->", file=sys.stderr
            )
    verdict = "meets" if worst <= TARGET else "MISSES"
    print(f"\nworst model-offload peak: {worst:.2f}x param+grad bytes ({verdict} the {TARGET}x target)")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
