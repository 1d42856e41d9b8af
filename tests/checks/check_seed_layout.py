"""Run tests.seed_layout_check once: the seed layout PP4 EP2 TP2 ETP2 on 16 ranks, use_distributed_optimizer=False,
the model built through the chosen bridge, one step trained and saved with its verified HF export, that export
loaded in transformers. Prints one JSON line; exits 1 if a check fails. On the Python 3.12 leg's stack it runs
Megatron-Bridge, upstream's default (too slow for that leg's suite on 2 cores); the main leg's suite runs the
same check through mbridge. Result: docs/cpu.md.

    .venv-py312/bin/python -m tests.checks.check_seed_layout [--bridge megatron-bridge|mbridge]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

BRIDGES = {"megatron-bridge": ("Megatron-Bridge", False), "mbridge": ("mbridge", True)}  # name, vanilla_mbridge


def main(argv: list[str] | None = None) -> int:
    from tests.seed_layout_check import seed_layout_problems, seed_layout_report
    from verl.models.tiny import make_tiny_hf_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bridge", choices=sorted(BRIDGES), default="megatron-bridge")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    name, vanilla_mbridge = BRIDGES[args.bridge]
    with tempfile.TemporaryDirectory(prefix="check_seed_layout_") as root:
        src = make_tiny_hf_model(os.path.join(root, "model"), kind="moe")
        report = seed_layout_report(src, root, vanilla_mbridge, timeout_s=args.timeout_s)
    problems = seed_layout_problems(report, name)
    print(json.dumps({**report, "problems": problems, "ok": not problems}))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
