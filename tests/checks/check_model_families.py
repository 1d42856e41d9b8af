"""Run tests.family_check (parity with transformers in fp32, bit-exact HF export, bit-exact resume)
for tiny models of the supported families at a chosen layout, outside the test suite: the PP4 EP2 TP2
ETP2 runs (16 ranks) and the transformers-5 venv (tests/checks/check_transformers5.sh). Prints one JSON line
per family and appends it to --json; exits 1 if any family fails. Results: docs/models.md.

    .venv/bin/python -m tests.checks.check_model_families --kinds mixtral --tp 2 --pp 4 --ep 2 --etp 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import tempfile
import time

# name -> (tiny model kind, config overrides); the names of tests/test_model_families.py's cases
FAMILIES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {"norm_topk_prob": False}),
    "qwen3_moe": ("moe", {}),
    "qwen3_moe-dense-layers": ("moe", {"mlp_only_layers": [0, 2]}),
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("dense", {}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["mixtral"], choices=list(FAMILIES))
    for size in ("tp", "pp", "ep", "etp"):
        parser.add_argument(f"--{size}", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny models (a multiple of pp)")
    parser.add_argument("--no-resume", action="store_true", help="parity and the export's round trip only")
    parser.add_argument("--json", default=None, help="append each result as a JSON line here")
    args = parser.parse_args()

    import torch
    import transformers

    from tests.family_check import run_family_check
    from verl.models.tiny import make_tiny_hf_model
    from verl.utils.megatron.parallel import ParallelSizes

    sizes = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    world = args.tp * args.pp * max(1, args.ep * args.etp // args.tp)
    failed = False
    for name in args.kinds:
        kind, overrides = FAMILIES[name]
        with tempfile.TemporaryDirectory(prefix=f"family_{name}_") as root:
            src = make_tiny_hf_model(os.path.join(root, "src"), kind=kind, num_layers=args.layers, **overrides)
            start = time.monotonic()
            result = run_family_check(src, os.path.join(root, "run"), world, sizes, resume=not args.no_resume)
            seconds = time.monotonic() - start
        record = {
            "family": name,
            "layout": f"TP{args.tp} PP{args.pp} EP{args.ep} ETP{args.etp}",
            "world_size": world,
            "passed": result.passed,
            **dataclasses.asdict(result),
            "seconds": round(seconds, 1),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        print(json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(record) + "\n")
        failed |= not result.passed
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
