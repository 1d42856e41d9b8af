"""Run the family flag matrix (tests.family_check.matrix_cells) and write its table into docs/models.md.

Each cell is one supported family's tiny model with one config field toggled (a field mbridge's bridge
or transformers' modelling code reads). A cell refused by verl.models.support is recorded with the
refusal's field; with --bypass it is also run with the refusal switched off, to record the failure the
refusal prevents. Every other cell runs the per-family harness (parity with transformers, complete and
bit-exact HF export, bit-exact resume) on 1 rank (or --ranks with --tp/--pp/--ep/--etp). Prints one JSON line per cell.

    .venv/bin/python -m tests.checks.family_matrix --bypass --write-docs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from tests.family_check import matrix_cells, run_cells, table_rows, write_table
from verl.utils.megatron.parallel import ParallelSizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="run only the cells whose id contains one of these")
    parser.add_argument("--bypass", action="store_true", help="also run refused cells with the refusal off")
    parser.add_argument("--ranks", type=int, default=1)
    for size in ("tp", "pp", "ep", "etp"):
        parser.add_argument(f"--{size}", type=int, default=1)
    parser.add_argument("--json", help="append the JSON lines to this file")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/models.md (all cells, 1 rank)")
    args = parser.parse_args()
    if args.write_docs and (args.only or args.ranks != 1 or not args.bypass):
        parser.error("--write-docs writes the whole 1-rank table: use it with --bypass and without --only / --ranks")
    cells = [c for c in matrix_cells() if not args.only or any(s in c.id for s in args.only)]
    start = time.time()
    with tempfile.TemporaryDirectory() as root:
        sizes = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        outcomes = run_cells(cells, root, args.ranks, sizes, bypass=args.bypass)
    failed = 0
    for cell, outcome in zip(cells, outcomes, strict=True):
        line = {"cell": cell.id, "layout": f"{args.ranks} ranks, TP{args.tp} PP{args.pp} EP{args.ep} ETP{args.etp}", **outcome.as_json()}
        failed += outcome.verdict == "FAILS"
        print(json.dumps(line), flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(line) + "\n")
    print(f"{len(cells)} cells, {failed} failing, {time.time() - start:.0f} s", file=sys.stderr)
    if args.write_docs:
        write_table(table_rows(cells, outcomes))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
