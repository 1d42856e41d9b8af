"""Run tests.vpp_check (every chunk trained, saved and exported; bit-exact resume; logits equal to
transformers'; resharding to no VPP and back) at a layout too large for the suite: by default the seed layout
PP4 EP2 TP2 ETP2 with VPP2, 16 ranks, on an 8-layer tiny MoE (4 stages x 2 chunks). Prints one JSON line;
exits 1 if a check fails. Result: docs/checkpoint.md.

    .venv/bin/python -m tests.checks.check_vpp --tp 2 --pp 4 --ep 2 --etp 2 --vpp 2 --layers 8 --world-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    from tests.vpp_check import logits_gap, missing_layer_rows, reshard_round_trip, train_save_continue_then_resume
    from verl.models.tiny import make_tiny_hf_model
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tp", 2), ("pp", 4), ("ep", 2), ("etp", 2), ("vpp", 2), ("layers", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--world-size", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    vpp = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp)
    no_vpp = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    world = args.world_size
    with tempfile.TemporaryDirectory(prefix="check_vpp_") as root:
        src = make_tiny_hf_model(os.path.join(root, "model"), kind="moe", num_hidden_layers=args.layers)
        vpp.validate(world, num_layers=args.layers)
        start = time.monotonic()
        results = run_on_ranks(train_save_continue_then_resume, world, vpp, args=(src, root), timeout_s=args.timeout_s)
        step2 = os.path.join(root, "global_step_2", "actor")
        trained = time.monotonic() - start
        round_trip = reshard_round_trip(src, step2, root, vpp, no_vpp, world)
        losses = zip(round_trip["back_losses"], round_trip["no_vpp_losses"], strict=True)
        report = {
            "layout": f"TP{args.tp} PP{args.pp} EP{args.ep} ETP{args.etp} VPP{args.vpp}",
            "world_size": world,
            "num_hidden_layers": args.layers,
            "chunks_per_rank": sorted({r["chunks"] for r in results}),
            "resume_bit_exact": all(r["continued"] == r["resumed"] and not r["differing"] for r in results),
            "missing_layer_rows": missing_layer_rows(step2, args.layers),
            "logits_gap_vs_transformers": logits_gap(os.path.join(step2, "model", "huggingface"), results[0]["logits"]),
            "reshard_to_no_vpp_exact": round_trip["no_vpp_exact"],
            "reshard_back_exact": round_trip["back_exact"],
            "next_loss_gap": max(abs(a - b) for a, b in losses),
            "train_save_resume_s": round(trained, 1),
            "total_s": round(time.monotonic() - start, 1),
        }
    ok = (
        report["chunks_per_rank"] == [args.vpp] and report["resume_bit_exact"] and not report["missing_layer_rows"]
        and report["logits_gap_vs_transformers"] <= 1e-5 and report["reshard_to_no_vpp_exact"]
        and report["reshard_back_exact"] and report["next_loss_gap"] < 1e-5
    )  # fmt: skip
    print(json.dumps({**report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
