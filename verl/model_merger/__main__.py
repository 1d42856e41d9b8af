"""``python -m verl.model_merger verify --local_dir <global_step_N/actor | default_local_dir>``.

Checks a checkpoint the way a load would (manifest sizes, contents, HF completeness) without
starting any rank, and prints what it found. Exit status 0: whole; 1: damaged (the reason printed).
"""

from __future__ import annotations

import argparse
import os
import sys

from verl.utils.checkpoint.integrity import (
    CheckpointError,
    find_resume_checkpoint,
    read_saved_layout,
    verify_checkpoint,
)
from verl.utils.checkpoint.names import TRACKER_FILENAME


def _verify(local_dir: str) -> int:
    if os.path.exists(os.path.join(local_dir, TRACKER_FILENAME)):
        path, notes = find_resume_checkpoint(local_dir)
        for note in notes:
            print(f"note: {note}")
        print(f"tracked step: {path}")
        local_dir = path
    contents = verify_checkpoint(local_dir)
    layout = read_saved_layout(local_dir)
    print(
        f"OK: {local_dir} is complete (step {contents['global_step']}, contents {contents['save_contents']}, "
        f"saved at {layout if layout is not None else 'a layout it does not record (saved by upstream verl)'})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.model_merger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check that a checkpoint is complete and loadable")
    verify.add_argument("--local_dir", required=True, help="a global_step_N/actor directory, or a run's default_local_dir")
    args = parser.parse_args(argv)
    try:
        return _verify(args.local_dir)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"DAMAGED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
