"""``python -m verl.model_merger verify --local_dir <global_step_N/actor | default_local_dir>``
``python -m verl.model_merger merge --backend megatron --local_dir <global_step_N/actor> --target_dir <dir>``

verify checks a checkpoint the way a load would (the manifest, the contents file, HF completeness) without
starting any rank, and prints what it found. Exit status 0: whole; 1: damaged (the reason printed).
merge writes the step's model as a complete HF folder and verifies it (docs/model_merger.md); upstream
verl's arguments and defaults. Exit status 0: merged; 1: damaged step or failed verification; 2: usage.
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
from verl.utils.checkpoint.layout import DATA_STATE_FILENAME, TRACKER_FILENAME
from verl.utils.one_line import one_line


def _verify(local_dir: str) -> int:
    if os.path.exists(os.path.join(local_dir, TRACKER_FILENAME)):
        path, notes = find_resume_checkpoint(local_dir)
        for note in notes:
            print(f"note: {note}")
        print(f"tracked step: {path}")
        local_dir = path
    contents = verify_checkpoint(local_dir)
    _check_data_position(local_dir)
    layout = read_saved_layout(local_dir)
    print(
        f"OK: {local_dir} is complete (step {contents['global_step']}, contents {contents['save_contents']}, "
        f"saved at {layout if layout is not None else 'a layout it does not record (saved by upstream verl)'})"
    )
    return 0


def _check_data_position(role_dir: str) -> None:
    """The step's ``data.pt`` beside the role's directory (the trainer's sampler position, outside the role's
    manifest), when there is one, holds only data: the trainer's resume loads it."""
    from verl.utils.checkpoint.data_only import load_weights_only

    path = os.path.join(os.path.dirname(os.path.abspath(role_dir)), DATA_STATE_FILENAME)
    if os.path.isfile(path):
        load_weights_only(path, path)


def _add_merge_parser(sub: argparse._SubParsersAction) -> None:
    """Upstream verl's ``merge`` arguments, names and defaults; ``--hf_model_path`` is ours (a step saved
    with use_dist_checkpointing=True and without 'hf_model' holds no HF config)."""
    merge = sub.add_parser("merge", help="write a step's model as a complete, verified HF folder")
    merge.add_argument("--backend", type=str, required=True, choices=["fsdp", "megatron"], help="the backend that saved the step (megatron only here)")
    merge.add_argument("--local_dir", type=str, default=None, help="a global_step_N/actor directory (or a run's default_local_dir: its tracked step)")
    merge.add_argument("--target_dir", type=str, default="tmp", help="where the HF folder goes; must not exist or be empty")
    merge.add_argument("--hf_model_path", type=str, default=None, help="the HF model the run started from, for a step without its own HF config")
    merge.add_argument("--tie-word-embedding", action="store_true", help="accepted for upstream's CLI; the config's tie_word_embeddings decides")
    merge.add_argument("--trust-remote-code", action="store_true", help="accepted for upstream's CLI; no effect: a folder's code never runs here, and a folder naming custom code is refused")
    merge.add_argument("--is-value-model", action="store_true", help="upstream's; refused here (actor checkpoints only)")
    merge.add_argument("--use_cpu_initialization", action="store_true", help="accepted for upstream's CLI; the model is always built on CPU here")
    merge.add_argument("--hf_upload_path", type=str, default=None, help="upstream's; refused here (no upload)")
    merge.add_argument("--private", action="store_true", help="upstream's, with --hf_upload_path")


def _merge(args: argparse.Namespace) -> int:
    from verl.model_merger.megatron_merge import MergeError, merge

    try:
        return merge(args)
    except MergeError as exc:
        print(f"merge failed: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.model_merger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check that a checkpoint is complete and loadable")
    verify.add_argument("--local_dir", required=True, help="a global_step_N/actor directory, or a run's default_local_dir")
    _add_merge_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "merge":
        return _merge(args)
    try:
        return _verify(args.local_dir)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"DAMAGED: {one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
