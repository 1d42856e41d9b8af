"""Resume from a cold page cache vs a plain ``safetensors.load_file`` of the same bytes, interleaved pairs.

One rank, the benchmark's Qwen3-MoE (``benchmarks.common.make_model``, ``--params``). One step is saved (model as
HF weights, optimizer, extra), and a safetensors file holding the same tensors (the rank's parameters and Adam
state) is written beside it. Each pair then, for each source tree given (``--tree``: this one, and e.g. a checkout
of an earlier commit to compare with), in alternating order:
1. a fresh rank builds the actor (not timed), drops the page cache (``/proc/sys/vm/drop_caches``: run as root),
   and times the resume end to end: the driver's pre-start check of the step, then the rank's load;
2. the page cache is dropped again and ``safetensors.torch.load_file`` of the plain file is timed;
3. the page cache is dropped again and the same ``load_file`` is timed with each tensor then copied into memory of
   its own (``clone``). ``load_file`` maps the file: its tensors are the page cache's pages, nothing is copied. A
   resume must land the bytes in the optimizer's and model's own memory, which this side does too.
The ratio of each pair is resume / plain (and resume / plain with its copy); the report gives each tree's medians
and spread, with the date and the machine's load. Numbers go in docs/perf.md, never in a test.

Usage (from the repository root, as root)::

    .venv/bin/python -m benchmarks.bench_resume --pairs 7 --tree . --tree /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD_CONTENTS = ("model", "optimizer", "extra")


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3")


def _actor(model_path: str):
    from benchmarks.common import engine

    contents = "[" + ",".join(LOAD_CONTENTS) + "]"
    return engine(model_path, f"checkpoint.save_contents={contents}", f"checkpoint.load_contents={contents}")


def _save(model_path: str, root: str, plain: str) -> int:
    """On the rank: train a step, save it, and write the plain file of the same tensors; its size."""
    import torch
    from safetensors.torch import save_file

    actor = _actor(model_path)
    actor.train_step([torch.randint(4, 200, (2, 33), generator=torch.Generator().manual_seed(0))])
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1, track=True)
    tensors = {f"param.{i}": p.detach().contiguous().clone() for i, p in enumerate(actor.model[0].parameters())}
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for i, values in enumerate(getattr(sub, "optimizer", sub).state.values()):
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    tensors[f"optim.{id(sub)}.{i}.{key}"] = value.detach().contiguous().clone()
    save_file(tensors, plain)
    return os.path.getsize(plain)


def _timed_resume(model_path: str, step: str) -> float:
    """On the rank: build the actor, drop the page cache, then time the driver's check and the rank's load as the
    tree at hand makes them (a tree with ``resume_check.check_step`` hands its record to the load)."""
    from verl.utils.checkpoint import integrity

    actor = _actor(model_path)
    manager = actor.checkpoint_manager
    drop_page_cache()
    start = time.perf_counter()
    try:
        from verl.utils.checkpoint.resume_check import LoadTarget, check_step
    except ImportError:  # a tree before the one resume check: the driver verifies, the ranks check again
        integrity.verify_checkpoint(step, manager.transformer_config, manager.hf_config)
        actor.load_checkpoint(step)
    else:
        target = LoadTarget(LOAD_CONTENTS, manager.use_distributed_optimizer, "float32")
        checked = check_step(step, target, manager.transformer_config, manager.hf_config)
        actor.load_checkpoint(step, checked=checked)
    return time.perf_counter() - start


def _on_one_rank(fn_name: str, *args: str) -> object:
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    return run_on_ranks(globals()[fn_name], 1, ParallelSizes(), args=args, timeout_s=900)[0]


def _in_tree(tree: str, fn_name: str, *args: str) -> object:
    """``fn_name(*args)`` on one rank, in a fresh process importing verl from ``tree`` and this file from this
    repository. It runs in ``tree``: ``python -c`` puts its working directory first on the path, before
    ``PYTHONPATH``, so run from a checkout it would import that checkout's verl whatever ``tree`` says."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((os.path.abspath(tree), REPO))}
    code = "import json, sys; from benchmarks import bench_resume as b; print('RESULT', json.dumps(b._on_one_rank(*sys.argv[1:])))"
    out = subprocess.run(
        [sys.executable, "-c", code, fn_name, *args], env=env, cwd=os.path.abspath(tree), capture_output=True, text=True, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{fn_name} in {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _timed_plain(plain: str, copy: bool = False) -> float:
    """``load_file`` of ``plain`` from a cold page cache; with ``copy``, each tensor then cloned into memory of its own."""
    from safetensors.torch import load_file

    drop_page_cache()
    start = time.perf_counter()
    tensors = load_file(plain)
    if copy:
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    elapsed = time.perf_counter() - start
    del tensors
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--params", type=float, default=60.1e6)
    parser.add_argument("--tree", action="append", help="a source tree whose verl/ to time (repeatable; default: this one)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    trees = args.tree or ["."]
    from benchmarks.common import make_model

    work = tempfile.mkdtemp(prefix="bench_resume_")
    model_path, count = make_model(os.path.join(work, "model"), args.params)
    root, plain = os.path.join(work, "ckpt"), os.path.join(work, "plain.safetensors")
    plain_bytes = _in_tree(trees[0], "_save", model_path, root, plain)
    step = os.path.join(root, "global_step_1", "actor")
    step_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(step) for f in names)
    ratios: dict[str, list[float]] = {tree: [] for tree in trees}
    copied_ratios: dict[str, list[float]] = {tree: [] for tree in trees}
    seconds: dict[str, list[tuple[float, float, float]]] = {tree: [] for tree in trees}
    for pair in range(args.pairs):
        for tree in trees if pair % 2 == 0 else trees[::-1]:
            resume = float(_in_tree(tree, "_timed_resume", model_path, step))
            base, copied = _timed_plain(plain), _timed_plain(plain, copy=True)
            ratios[tree].append(resume / base)
            copied_ratios[tree].append(resume / copied)
            seconds[tree].append((resume, base, copied))
            print(
                f"pair {pair + 1} {tree}: resume {resume:.2f}s, plain {base:.2f}s, plain + copy {copied:.2f}s, "
                f"ratios {resume / base:.2f} and {resume / copied:.2f}",
                flush=True,
            )
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "params": count,
        "step_bytes": step_bytes,
        "plain_bytes": plain_bytes,
        "load_average": os.getloadavg(),
        "trees": {
            tree: {
                "median_ratio": statistics.median(ratios[tree]),
                "min_ratio": min(ratios[tree]),
                "max_ratio": max(ratios[tree]),
                "median_ratio_to_plain_with_copy": statistics.median(copied_ratios[tree]),
                "min_ratio_to_plain_with_copy": min(copied_ratios[tree]),
                "max_ratio_to_plain_with_copy": max(copied_ratios[tree]),
                "seconds": seconds[tree],  # resume, plain, plain with its copy
            }
            for tree in trees
        },
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
