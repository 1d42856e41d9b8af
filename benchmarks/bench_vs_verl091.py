#!/usr/bin/env python
"""Checkpoint save time side by side: this package's worker save vs verl 0.9.1's MegatronCheckpointManager.

The same Qwen3-MoE (``benchmarks/common.py``'s ``make_model``: hidden 512, 8 layers, 16 experts, fp32,
~60M parameters, written once), ``use_distributed_optimizer=False``, save contents model / optimizer / extra /
hf_model, each side's default ``use_dist_checkpointing`` (False: the model is kept as HF weights), sync mode:

* **ours**: ``MegatronEngine.save_checkpoint`` (``verl/workers/engine/megatron/transformer_impl.py``), the worker's path with the
  product's defaults: staging directory, the manager's parts, then the commit step (HF folder verified against
  the config, manifest with CRC-32 checksums, fsync of the tree, rename into place); it returns once committed;
* **verl 0.9.1**: its ``MegatronCheckpointManager.save_checkpoint`` (it returns once its ``ckpt_contents.json``
  is written; it does not fsync), built with upstream's helpers through ``interop/verl091_interop.py`` (the
  0.9.1 venv, its CPU shim and its local-spec bridge, which loads at any TP / ETP).

Per layout (1 rank; 4 ranks PP2 EP2; 4 ranks TP2 PP2 ETP2) both sides run at once as two groups of long-lived
gloo ranks, each in its own interpreter, started by this script (``_serve``). Each rank builds its model from
the HF folder, builds Adam through upstream's helpers (``McoreOptimizerConfig`` -> ``init_megatron_optim_config``
-> ``get_megatron_optimizer``) and takes one optimizer step on seeded gradients, so the optimizer holds its
moments (no forward pass: 0.9.1's shim does not run the MoE forward at TP2). Then the driver orders saves one at a
time, interleaved -- ours, theirs, ours, theirs, ... -- first ``--warmup`` per side (reported, not counted), then
``--saves`` per side. A save is timed on every rank from a barrier to its return; the save's time is the slowest
rank's. Between saves (untimed) the step directory is removed and the page cache synced, so one side's dirty
pages are not written back during the other's save. Our save's phases come from its report
(``last_committed.phase_seconds``, the writer's and the commit's) of the slowest rank.

Usage (this repository's venv; the 0.9.1 venv as in docs/upstream-interop.md)::

    .venv/bin/python -m benchmarks.bench_vs_verl091                                # ~10-20 min on 2 vCPUs
    .venv/bin/python -m benchmarks.bench_vs_verl091 --layouts 1 --params 10e6 --saves 1 --warmup 0   # a quick try

Writes ``--out`` (JSON) and prints markdown tables; targets (ours <= 0.8x at 1 rank, <= 0.5x at 4 ranks) are
reported, never enforced.

``--profile-save`` times nothing: per layout each side makes one save (the first) under
``sys.setprofile`` and ``threading.setprofile``, and lists the files and named functions of that side's own
``verl/`` package the save call enters, in every thread it starts, for 0.9.1's manager save too (what mbridge or megatron-core run is outside ``verl/`` on both sides, so not counted).
Ours: ``MegatronEngine.save_checkpoint(..., track=True)``, our CPU runtime left out (device placement);
0.9.1: ``MegatronCheckpointManager.save_checkpoint`` (its CPU shim lives in ``verl091_interop.py``, outside
its package). Writes ``--out`` (default ``outputs/bench_vs_verl091_profile.json``) and prints the listing::

    .venv/bin/python -m benchmarks.bench_vs_verl091 --profile-save --layouts 1rank --params 10e6
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# Only the standard library, the shared helper and verl091_interop (both standard library at import) at the top: this file
# runs under both interpreters, and megatron's writer helper process imports it again.
from benchmarks.common import engine, optim_overrides, prime_optimizer
from interop import verl091_interop as interop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ("benchmarks", "interop")  # what this file imports of this repository besides verl

# name -> (world size, TP, PP, EP, ETP)
LAYOUTS = {
    "1rank": (1, 1, 1, 1, 1),
    "pp2_ep2": (4, 1, 2, 2, 1),
    "tp2_pp2_etp2": (4, 2, 2, 1, 2),
}
LABELS = {"1rank": "1 rank", "pp2_ep2": "4 ranks PP2 EP2", "tp2_pp2_etp2": "4 ranks TP2 PP2 ETP2"}
TARGETS = {"1rank": 0.8, "pp2_ep2": 0.5, "tp2_pp2_etp2": 0.5}  # ours / theirs, at most
SIDES = ("ours", "verl091")
REPLY = "BENCH-REPLY "
PHASES = ("dist_checkpoints", "hf_config", "hf_weights", "hf_verify", "commit")


# --------------------------------------------------------------------------- one rank (either interpreter)


@contextlib.contextmanager
def entered_functions(found: set):
    """Add ``(file, qualname)`` for each named function of the imported ``verl`` package entered inside the block,
    in this thread and in threads started inside it (comprehensions and lambdas left out, and our CPU runtime:
    device placement only, as in the suite's test). ``file`` is relative to the package's parent directory."""
    import verl

    package = os.path.dirname(os.path.abspath(verl.__file__)) + os.sep
    root = os.path.dirname(package.rstrip(os.sep))
    skip = os.path.join(package, "utils", "megatron", "cpu_runtime.py")

    def note(frame, event, arg) -> None:
        code = frame.f_code
        name = code.co_filename
        if event == "call" and name.startswith(package) and name != skip and "<" not in code.co_qualname:
            found.add((os.path.relpath(name, root), code.co_qualname))

    threading.setprofile(note)
    sys.setprofile(note)
    try:
        yield found
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def build_saver(side: str, model_path: str, seed: int):
    """Build this side's model, optimizer and checkpoint path; return ``save(step_dir, step, probe) -> phases or
    None``; ``probe``, a context manager, encloses the save call alone."""
    if side == "ours":
        actor = engine(model_path, "megatron.dtype=float32", *optim_overrides(interop.OPTIM))
        prime_optimizer(actor.model, actor.optimizer, actor.scheduler, seed)

        def save(step_dir: str, step: int, probe=None) -> dict:
            with probe or contextlib.nullcontext():  # sync: returns once committed; profiled: tracked, as the test
                actor.save_checkpoint(step_dir, global_step=step, track=probe is not None)
            return {"mode": actor.checkpoint_manager.last_save.mode.value, "phases": dict(actor.last_committed.phase_seconds)}

        return save

    hf_config, tokenizer = interop.load_hf(model_path)  # a model transformers 5 wrote, read by 0.9.1's transformers 4
    bridge = interop.build_bridge(side, hf_config)
    model = interop.build_model(side, bridge, hf_config)
    bridge.load_weights(model, model_path)
    optim_config, optimizer, scheduler = interop.build_optimizer(side, model)
    prime_optimizer(model, optimizer, scheduler, seed)
    manager = interop.build_manager(model, bridge, hf_config, tokenizer, optimizer, scheduler, optim_config, model_path)

    def save(step_dir: str, step: int, probe=None) -> None:
        with probe or contextlib.nullcontext():
            manager.save_checkpoint(local_path=step_dir, global_step=step)

    return save


def rank_main(
    side: str,
    rank: int,
    world: int,
    port: int,
    layout: str,
    model_path: str,
    root: str,
    threads: int,
    commands,
    results,
) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        _, tp, pp, ep, etp = LAYOUTS[layout]
        interop.setup_rank(side, rank, world, port, pp, ep, tp=tp, etp=etp)
        import torch

        torch.set_num_threads(threads)
        start = time.monotonic()
        save = build_saver(side, model_path, seed=interop.SEED + rank)
        torch.distributed.barrier()
        results.put((rank, {"build_s": time.monotonic() - start, "pid": os.getpid()}))
        while (command := commands.get()) is not None:
            step = command["step"]
            step_root = os.path.join(root, f"global_step_{step}")
            entered = set()
            probe = entered_functions(entered) if command.get("profile") else None
            gc.collect()
            torch.distributed.barrier()
            start = time.monotonic()
            report = save(os.path.join(step_root, "actor"), step, probe)
            seconds = time.monotonic() - start
            torch.distributed.barrier()
            out = {"save_s": seconds, "report": report}
            if probe is not None:
                out["entered"] = sorted(entered)
            if rank == 0:  # untimed: the step's size, then it goes, and the page cache is written back
                out["bytes"] = interop.tree_bytes(step_root)
                shutil.rmtree(step_root)
                os.sync()
            torch.distributed.barrier()
            results.put((rank, out))
    except BaseException:  # report, then fail the rank
        results.put((rank, {"error": traceback.format_exc()}))
        raise


def serve(args) -> None:
    """One side's ranks, kept alive; a JSON line on stdin per command ({"step": N}, {"step": N, "profile": true} or
    {"quit": true}), a reply line on stdout for each (``REPLY`` + JSON)."""
    interop.check_side(args.side)
    import torch.multiprocessing as mp

    world = LAYOUTS[args.layout][0]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    commands = [ctx.Queue() for _ in range(world)]
    port = interop.free_port()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(
                args.side,
                rank,
                world,
                port,
                args.layout,
                args.model,
                args.root,
                args.threads,
                commands[rank],
                results,
            ),
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()

    def reply(payload: dict) -> None:
        sys.stdout.write(REPLY + json.dumps(payload) + "\n")
        sys.stdout.flush()

    def collect() -> list[dict]:
        got = {}
        while len(got) < world:
            rank, value = results.get(timeout=args.timeout)
            if "error" in value:
                reply({"error": f"rank {rank}: {value['error']}"})
                raise SystemExit(1)
            got[rank] = value
        return [got[rank] for rank in range(world)]

    try:
        reply({"ready": collect()})
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("quit"):
                break
            for q in commands:
                q.put(command)
            reply({"ranks": collect()})
    finally:
        for q in commands:
            q.put(None)
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


# --------------------------------------------------------------------------- the driver (this repository's venv)


def side_path(side: str, root: str) -> str:
    """``PYTHONPATH`` of a side's ``_serve``: this repository for ours (its verl, also where the venv's editable
    install points at another checkout); for 0.9.1 a folder under ``root`` linking only ``ROOMS``, so that
    interpreter imports this file and the harness but its own verl."""
    if side == "ours":
        return REPO
    folder = os.path.join(root, "rooms")
    os.makedirs(folder, exist_ok=True)
    for room in ROOMS:
        if not os.path.lexists(os.path.join(folder, room)):
            os.symlink(os.path.join(REPO, room), os.path.join(folder, room))
    return folder


class Server:
    """One side's ``_serve`` process: send a command, wait for its reply; everything else it prints goes to a log."""

    def __init__(
        self, python: str, side: str, layout: str, model: str, root: str, threads: int, log_path: str, timeout: float
    ):
        self.side, self.timeout, self.log_path = side, timeout, log_path
        self._log = open(log_path, "w")
        argv = [python, "-m", "benchmarks.bench_vs_verl091", "_serve", "--side", side, "--layout", layout, "--model", model]
        argv += ["--root", root, "--threads", str(threads), "--timeout", str(timeout)]
        kwargs = interop.side_process_kwargs()  # outside the repository: each side imports its own verl
        kwargs["env"]["PYTHONPATH"] = side_path(side, root)
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, **kwargs
        )
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._replies.put(json.loads(line[len(REPLY) :]))
            else:
                self._log.write(line)
                self._log.flush()
        self._replies.put({"error": f"exited with {self.proc.wait()}"})

    def reply(self) -> dict:
        try:
            got = self._replies.get(timeout=self.timeout)
        except queue.Empty:
            got = {"error": f"no reply in {self.timeout:.0f}s"}
        if "error" in got:
            self.close()
            with open(self.log_path) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"{self.side} side failed: {got['error']}\n--- log tail ({self.log_path}) ---\n{tail}")
        return got

    def save(self, step: int, profile: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"step": step, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._log.close()


def one_save(ranks: list[dict]) -> dict:
    """A save as the slowest rank saw it; our phases from that rank's report."""
    slowest = max(range(len(ranks)), key=lambda r: ranks[r]["save_s"])
    out = {"save_s": ranks[slowest]["save_s"], "per_rank_s": [r["save_s"] for r in ranks], "slowest_rank": slowest}
    out["bytes"] = ranks[0]["bytes"]
    report = ranks[slowest]["report"]
    if report is not None:
        phases = {k: report["phases"].get(k, 0.0) for k in PHASES}
        phases["other"] = max(
            0.0, out["save_s"] - sum(phases.values())
        )  # staging, finite check, contents file, barriers
        out["mode"], out["phases_s"] = report["mode"], phases
    return out


def entered_listing(ranks: list[dict]) -> dict:
    """One side's profiled save: rank 0's files and functions (``utils/checkpoint`` apart), each rank's counts."""
    entered = ranks[0]["entered"]
    files = sorted({path for path, _ in entered})
    in_checkpoint = [path for path in files if path.startswith(os.path.join("verl", "utils", "checkpoint") + os.sep)]
    return {
        "files": len(files),
        "functions": len(entered),
        "checkpoint_files": len(in_checkpoint),
        "checkpoint_functions": sum(1 for path, _ in entered if path in in_checkpoint),
        "per_rank": [{"files": len({p for p, _ in r["entered"]}), "functions": len(r["entered"])} for r in ranks],
        "listing": {path: [name for p, name in entered if p == path] for path in files},
    }


def profile_markdown(results: dict) -> str:
    lines = []
    for x in results["layouts"].values():
        lines += [f"### {x['label']}: what one sync save enters inside each side's `verl/` (rank 0)", ""]
        for side in SIDES:
            p = x[side]
            lines.append(
                f"**{side}**: {p['files']} files, {p['functions']} functions; in verl/utils/checkpoint/: "
                f"{p['checkpoint_files']} files, {p['checkpoint_functions']} functions"
            )
            lines += ["", "| file | functions | names |", "|---|---|---|"]
            lines += [f"| `{path}` | {len(names)} | {', '.join(names)} |" for path, names in p["listing"].items()]
            lines.append("")
    return "\n".join(lines)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"load average: {loadavg()}"


def run_layout(layout: str, model: str, work: str, args) -> dict:
    pythons = {"ours": sys.executable, "verl091": args.verl091_python}
    shutil.rmtree(work, ignore_errors=True)
    servers = {}
    started = time.monotonic()
    try:
        for side in SIDES:
            root = os.path.join(work, side, "ckpt")
            os.makedirs(root)
            log = os.path.join(work, f"{side}.log")
            servers[side] = Server(pythons[side], side, layout, model, root, args.threads, log, args.timeout)
        built = {side: servers[side].reply()["ready"] for side in SIDES}
        print(f"[{layout}] built both sides in {time.monotonic() - started:.0f}s; load {loadavg()}", flush=True)
        if args.profile_save:
            profiles = {side: entered_listing(servers[side].save(1, profile=True)["ranks"]) for side in SIDES}
        saves: dict[str, dict[str, list]] = {side: {"warmup": [], "timed": []} for side in SIDES}
        loads = []
        step = 0
        for kind, count in () if args.profile_save else (("warmup", args.warmup), ("timed", args.saves)):
            for _ in range(count):
                step += 1
                for side in SIDES:  # interleaved: ours, theirs, ours, theirs, ...
                    save = one_save(servers[side].save(step)["ranks"])
                    saves[side][kind].append(save)
                    print(
                        f"[{layout}] {kind} save {step} {side}: {save['save_s']:.2f}s (slowest rank {save['slowest_rank']})",
                        flush=True,
                    )
                loads.append(loadavg())
    finally:
        for server in servers.values():
            server.close()
    shutil.rmtree(work, ignore_errors=True)
    if args.profile_save:
        return {"label": LABELS[layout], "wall_s": time.monotonic() - started, **profiles}
    return summarize(layout, saves, built, loads, time.monotonic() - started)


def summarize(layout: str, saves: dict, built: dict, loads: list[str], wall: float) -> dict:
    world, tp, pp, ep, etp = LAYOUTS[layout]
    out = {
        "label": LABELS[layout],
        "layout": {"world": world, "tp": tp, "pp": pp, "ep": ep, "etp": etp},
        "wall_s": wall,
        "loadavg_during": loads,
        "target_ratio": TARGETS[layout],
    }
    for side in SIDES:
        timed = saves[side]["timed"]
        times = [s["save_s"] for s in timed]
        entry = {
            "median_s": statistics.median(times) if times else None,
            "saves_s": times,
            "warmup_s": [s["save_s"] for s in saves[side]["warmup"]],
            "per_rank_s": [s["per_rank_s"] for s in timed],
            "step_bytes": timed[-1]["bytes"] if timed else None,
            "build_s": max(r["build_s"] for r in built[side]),
        }
        if side == "ours" and timed:
            entry["mode"] = sorted({s["mode"] for s in timed})
            entry["phases_median_s"] = {
                k: statistics.median(s["phases_s"][k] for s in timed) for k in (*PHASES, "other")
            }
            entry["phases_s"] = [s["phases_s"] for s in timed]
        out[side] = entry
    if out["ours"]["median_s"] and out["verl091"]["median_s"]:
        out["ratio_ours_over_verl091"] = out["ours"]["median_s"] / out["verl091"]["median_s"]
        out["target_met"] = out["ratio_ours_over_verl091"] <= TARGETS[layout]
    return out


def summary(results: dict) -> dict:
    """The run in a few lines: per layout the medians, the ratio and our phases (docs/perf.md shows it)."""
    out = {
        "params": results["params"],
        "saves_per_side": results["saves"],
        "warmup_per_side": results["warmup"],
        "uptime_before": results["uptime_before"],
        "uptime_after": results["uptime_after"],
        "layouts": {},
    }
    for key, x in results["layouts"].items():
        out["layouts"][key] = {
            "ours_median_s": round(x["ours"]["median_s"], 3),
            "verl091_median_s": round(x["verl091"]["median_s"], 3),
            "ratio_ours_over_verl091": round(x["ratio_ours_over_verl091"], 3),
            "target_ratio": x["target_ratio"],
            "target_met": x["target_met"],
            "ours_saves_s": [round(t, 2) for t in x["ours"]["saves_s"]],
            "verl091_saves_s": [round(t, 2) for t in x["verl091"]["saves_s"]],
            "ours_phases_median_s": {k: round(v, 3) for k, v in x["ours"]["phases_median_s"].items()},
            "loadavg_during": x["loadavg_during"],
        }
    return out


def markdown(results: dict) -> str:
    keys = list(results["layouts"])
    lay = [results["layouts"][k] for k in keys]
    lines = [
        f"model: {results['params'] / 1e6:.1f}M params (fp32, {results['overrides']['num_experts']} experts); "
        f"median of {results['saves']} saves per side after {results['warmup']} warm-up, slowest rank; "
        f"uptime before: `{results['uptime_before']}`; after: `{results['uptime_after']}`",
        "",
        "| | " + " | ".join(x["label"] for x in lay) + " |",
        "|---|" + "---|" * len(lay),
    ]

    def row(label: str, fn) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(x) for x in lay) + " |")

    def fmt(value, spec=".2f") -> str:
        return "-" if value is None else format(value, spec)

    row("**ours** (worker save, until committed), median s", lambda x: f"**{fmt(x['ours']['median_s'])}**")
    row("&nbsp;&nbsp;each timed save, s", lambda x: " / ".join(f"{t:.2f}" for t in x["ours"]["saves_s"]))
    row("**verl 0.9.1** (manager save), median s", lambda x: f"**{fmt(x['verl091']['median_s'])}**")
    row("&nbsp;&nbsp;each timed save, s", lambda x: " / ".join(f"{t:.2f}" for t in x["verl091"]["saves_s"]))
    row("**ours / verl 0.9.1**", lambda x: f"**{fmt(x.get('ratio_ours_over_verl091'))}x**")
    row("target (at most)", lambda x: f"{x['target_ratio']}x")
    row("met?", lambda x: {True: "yes", False: "**no**", None: "-"}[x.get("target_met")])
    row(
        "warm-up saves (not counted), ours / 0.9.1, s",
        lambda x: ", ".join(
            f"{a:.2f} / {b:.2f}" for a, b in zip(x["ours"]["warmup_s"], x["verl091"]["warmup_s"], strict=True)
        ),
    )
    for phase in (*PHASES, "other"):
        row(f"&nbsp;&nbsp;ours: {phase}, median s", lambda x, p=phase: fmt(x["ours"].get("phases_median_s", {}).get(p)))
    row(
        "step size, ours / 0.9.1, MiB",
        lambda x: f"{x['ours']['step_bytes'] / 2**20:.0f} / {x['verl091']['step_bytes'] / 2**20:.0f}",
    )
    row(
        "load average during the saves (1 min)",
        lambda x: (
            f"{min(float(v.split()[0]) for v in x['loadavg_during']):.1f}-{max(float(v.split()[0]) for v in x['loadavg_during']):.1f}"
        ),
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("_serve")
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--layout", choices=list(LAYOUTS), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--params", type=float, default=61e6, help="model size (default 61e6: ~60M with 16 experts)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--saves", type=int, default=5, help="timed saves per side and layout (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="saves per side before the timed ones (reported apart)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank, both sides (the rank launcher's default)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one reply")
    parser.add_argument("--verl091-python", default=interop.DEFAULT_VERL091_PYTHON)
    parser.add_argument(
        "--profile-save",
        action="store_true",
        help="time nothing: list the files and functions of each side's verl/ one sync save enters",
    )
    parser.add_argument("--out", default=None, help="default outputs/bench_vs_verl091.json (_profile.json)")
    parser.add_argument(
        "--workdir", default=None, help="where models and checkpoints go (default: a temp dir under outputs/)"
    )
    args = parser.parse_args(argv)
    if args.command == "_serve":
        serve(args)
        return 0
    args.out = args.out or f"outputs/bench_vs_verl091{'_profile' if args.profile_save else ''}.json"

    interop.check_side("ours")
    from benchmarks.common import machine, make_model, model_overrides

    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_vs_verl091_", dir=out_dir))
    os.makedirs(base, exist_ok=True)
    started = time.monotonic()
    try:
        results = {"uptime_before": uptime(), "machine": machine()}
        model, params = make_model(os.path.join(base, "hf_source"), args.params, args.experts)
        print(f"model: {params / 1e6:.1f}M params at {model}; {results['uptime_before']}", flush=True)
        results.update(
            params=params,
            overrides=model_overrides(args.params, args.experts),
            saves=args.saves,
            warmup=args.warmup,
            threads_per_rank=args.threads,
            layouts={},
        )
        for layout in args.layouts:
            results["layouts"][layout] = run_layout(layout, model, os.path.join(base, layout), args)
        results["uptime_after"] = uptime()
        results["wall_s"] = time.monotonic() - started
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    print()
    if args.profile_save:
        print(profile_markdown(results))
        print(f"wrote {args.out} ({results['wall_s']:.0f}s)")
        return 0
    print(markdown(results))
    print(json.dumps(summary(results), indent=1))
    print(f"wrote {args.out} ({results['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
