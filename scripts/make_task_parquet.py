"""Write the embedded task as a parquet file in upstream verl's RLHFDataset format.

    python scripts/make_task_parquet.py --out-dir data/ [--seed 1] [--max-operand 2] [--task first]

It imports the installed verl (scripts/run.sh and scripts/test.sh install it into .venv).

The default run (``data.train_files=null``) writes and reads this same file (verl.trainer.data_plan), so
``data.train_files=<the printed path>`` trains on exactly what the default run does. Rows: ``prompt``
(one user message ``"a+b="``), ``data_source`` ("arithmetic"), ``reward_model.ground_truth``, ``extra_info``.
"""

from __future__ import annotations

import argparse
import os

from verl.utils.dataset.arithmetic import TASKS, write_task_parquet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seed", type=int, default=1, help="data.seed (the row order)")
    parser.add_argument("--max-operand", type=int, default=2, help="data.max_operand (0..9)")
    parser.add_argument("--task", choices=sorted(TASKS), default="first", help="data.task")
    args = parser.parse_args(argv)
    print(write_task_parquet(os.path.abspath(args.out_dir), args.seed, args.max_operand, args.task))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
