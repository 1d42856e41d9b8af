"""What the manifest's content checksums cost: at save (the commit step hashes every file) and at resume
(the pre-load check hashes them again), against the save itself.

One rank saves a checkpoint of a Qwen3-MoE of about ``--params`` parameters (fp32; the model of
benchmarks/common.py) twice, synchronously (the second save is the one timed: megatron's plan is
then cached); then the manifest is built (sizes + CRC-32 of every file) and verified, each timed. Numbers go
to docs/perf.md; nothing is enforced.

Usage: .venv/bin/python -m benchmarks.bench_checksums [--params 40e6] [--out outputs/bench_checksums.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _run(model: str, root: str) -> dict:
    from benchmarks.common import engine
    from verl.utils.checkpoint.integrity import build_manifest, verify_manifest

    actor = engine(model)
    actor.train_step([actor.tokenizer("1+1=2", return_tensors="pt")["input_ids"].repeat(2, 4)])
    times = []
    for step in (1, 2):
        path = os.path.join(root, f"global_step_{step}", "actor")
        start = time.monotonic()
        actor.save_checkpoint(path, global_step=step)
        times.append(time.monotonic() - start)
    start = time.monotonic()
    build_manifest(path)
    manifest_s = time.monotonic() - start
    start = time.monotonic()
    verify_manifest(path)
    verify_s = time.monotonic() - start
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return {"bytes": size, "save_s": times[1], "manifest_with_checksums_s": manifest_s, "verify_s": verify_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=40e6)
    parser.add_argument("--out", default="outputs/bench_checksums.json")
    args = parser.parse_args()
    from benchmarks.common import make_model
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    with tempfile.TemporaryDirectory() as tmp:
        model, params = make_model(os.path.join(tmp, "model"), args.params)
        result = run_on_ranks(_run, 1, ParallelSizes(), args=(model, os.path.join(tmp, "ckpt")), timeout_s=1800)[0]
    result["params"] = params
    result["checksum_share_of_save"] = result["manifest_with_checksums_s"] / result["save_s"]
    result["verify_share_of_save"] = result["verify_s"] / result["save_s"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
