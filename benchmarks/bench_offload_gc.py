#!/usr/bin/env python
"""What a reference model's reload + offload costs in a worker's heap, before and after
``verl.utils.host_memory.freeze_long_lived_objects`` (the worker calls it at the end of ``init_model``).

Each offload helper runs ``gc.collect()`` per call, as upstream's do; in a process holding torch, megatron,
transformers and Ray that is a full scan of ~500k objects. One rank builds the actor and the reference
from a Qwen3-MoE (``benchmarks/common.py``'s ``make_model``), then times ``--cycles`` reference
reload + offload cycles and one ``gc.collect`` before and after the freeze, and prints a JSON line.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.bench_offload_gc              # ~60M parameters; ~1 min
    .venv/bin/python -m benchmarks.bench_offload_gc --params 10e6
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time


def _measure(model_path: str, cycles: int) -> dict:
    import ray  # noqa: F401 - what a worker's heap holds
    import transformers  # noqa: F401

    from benchmarks.common import engine
    from verl.utils.host_memory import freeze_long_lived_objects
    from verl.utils.megatron_utils import load_megatron_model_to_gpu, offload_megatron_model_to_cpu
    from verl.workers.engine.megatron.transformer_impl import MegatronReference

    actor = engine(model_path, "megatron.dtype=float32")
    reference = MegatronReference(model_path, vanilla_mbridge=True)

    def cycle() -> float:
        start = time.monotonic()
        load_megatron_model_to_gpu(reference.model, load_grad=False)
        offload_megatron_model_to_cpu(reference.model, offload_grad=False)
        return time.monotonic() - start

    def collect() -> float:
        start = time.monotonic()
        gc.collect()
        return time.monotonic() - start

    out = {"tracked_objects": len(gc.get_objects()), "actor_chunks": len(actor.model)}
    out["cycle_s_before"] = [round(cycle(), 3) for _ in range(cycles)]
    out["gc_collect_s_before"] = round(collect(), 3)
    freeze_long_lived_objects()
    out["cycle_s_after"] = [round(cycle(), 3) for _ in range(cycles)]
    out["gc_collect_s_after"] = round(collect(), 3)
    out["median_cycle_s"] = {k: statistics.median(out[f"cycle_s_{k}"]) for k in ("before", "after")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=61e6)
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()

    from benchmarks.common import make_model
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    with tempfile.TemporaryDirectory() as tmp:
        model_path, count = make_model(os.path.join(tmp, "model"), args.params, 16)
        result = run_on_ranks(_measure, 1, ParallelSizes(), args=(model_path, args.cycles), timeout_s=1200)[0]
    print(json.dumps({"params": count, **result}))


if __name__ == "__main__":
    main()
