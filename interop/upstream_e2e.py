"""Upstream verl's own e2e launch script, ``tests/special_e2e/run_ppo_trainer_megatron.sh``, run against THIS package.

    python -m interop.upstream_e2e [UPSTREAM_GIT_DIR] [--bridge megatron-bridge|mbridge] [--engine hf|vllm] [--keep DIR]

The script is exported from the upstream git dir at the pinned commit (``upstream_tests.PINNED_COMMIT``; nothing
is copied into this repository) and driven only by its environment variables and its trailing ``$@``:
``ADV_ESTIMATOR=grpo``, ``VANILLA_MBRIDGE`` (False: Megatron-Bridge, upstream's default), the sizes (TP1 PP2 EP2
ETP1 on 4 ranks, no VPP, no CP), the model path (the tiny Qwen3-MoE this package makes), ``ENGINE`` (``hf``, or
``vllm``, the script's default: vLLM's CPU build in-process) and the data files (the embedded task as parquet). Its trailing arguments add what this host
needs: ``reward.reward_model.enable=False`` (the script turns on a reward model this package does not build), the
checkpoint directory, and the file logger. Run 1 trains two steps saving each; run 2 resumes from step 1
(``RESUME_MODE=resume_path``) and must repeat step 2 exactly (metrics and HF export bit for bit). The trainer command line the script builds in run 1 is recorded and must
equal the one ``interop/upstream_e2e_argv.py`` holds (paths, bridge and engine as placeholders), so the
suite's check of those overrides is a check of what this run trained with.

On a host without CUDA the script's device probe (``python3 -`` printing ``get_device_name()``; its only branches
are cuda and npu) is answered ``cuda`` by a ``python3`` placed first on PATH, which runs everything else with
this interpreter; so the CUDA branch, the one a GPU host runs, is what runs. Exit status: 0 when both runs
passed and step 2 repeated exactly, 1 otherwise, 2 on bad input. Not part of CI (CI has no upstream checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from interop.upstream_e2e_argv import E2E_ARGV, E2E_COMMIT
from interop.upstream_tests import PINNED_COMMIT, resolve_git_dir

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "tests/special_e2e/run_ppo_trainer_megatron.sh"
CLOCKS = ("time", "checkpoint", "checkpoint_committed", "resume")  # what may differ between runs
TRAINER_MODULE = "verl.trainer.main_ppo"
# First on PATH as `python3`: records the trainer's command line (NUL-separated, into $UPSTREAM_E2E_ARGV); on a
# host without CUDA it answers the device probe (Python read from stdin) as a CUDA host would; all else runs as is.
PROBE_SHIM = """#!/usr/bin/env bash
if [ "{answer_probe}" = 1 ] && [ "$#" -eq 1 ] && [ "$1" = "-" ]; then cat > /dev/null; echo cuda; exit 0; fi
for arg in "$@"; do
  if [ "$arg" = "{trainer}" ] && [ -n "${{UPSTREAM_E2E_ARGV:-}}" ]; then printf '%s\\0' "$@" > "$UPSTREAM_E2E_ARGV"; fi
done
exec "{python}" "$@"
"""


def _environment(work: Path, bridge: str, engine: str, steps: int) -> dict[str, str]:
    from verl.models.tiny import make_tiny_hf_model
    from verl.utils.dataset.arithmetic import write_task_parquet

    model = work / "model"
    if not model.is_dir():
        make_tiny_hf_model(str(model), kind="moe")
    data = write_task_parquet(str(work / "data"), 1, 2, "first")
    env = dict(os.environ)
    shim = work / "bin"
    shim.mkdir(exist_ok=True)
    answer_probe = "0" if _has_cuda() else "1"
    (shim / "python3").write_text(PROBE_SHIM.format(python=sys.executable, trainer=TRAINER_MODULE, answer_probe=answer_probe))
    (shim / "python3").chmod(0o755)
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    env.update(
        PYTHONPATH=str(REPO), VERL_USE_UV="0", NUM_GPUS="4", ENGINE=engine, MODEL_ID="tiny/qwen3-moe",
        MODEL_PATH=str(model), TRAIN_FILES=data, VAL_FILES=data, ADV_ESTIMATOR="grpo",
        VANILLA_MBRIDGE=str(bridge == "mbridge"), COMMON_PP="2", COMMON_VPP="null", COMMON_CP="1", COMMON_TP="1",
        COMMON_EP="2", COMMON_ETP="1", INFER_TP="1", ALL_OFFLOAD="False", SAVE_FREQ="1",
        TOTAL_TRAIN_STEPS=str(steps), MAX_PROMPT_LENGTH="16", MAX_RESPONSE_LENGTH="8",
    )  # fmt: skip
    return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run(script: Path, env: dict[str, str], extra: list[str], log: Path) -> int:
    print(f"[upstream-e2e] bash {script.name} {' '.join(extra)}  (log: {log})", flush=True)
    env = {**env, "UPSTREAM_E2E_ARGV": str(log.with_suffix(".argv"))}
    with open(log, "w") as out:
        return subprocess.run(["bash", str(script), *extra], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode


def recorded_argv(log: Path) -> list[str]:
    """The trainer's arguments (after ``-m verl.trainer.main_ppo``) the script ran in the run logged at ``log``."""
    path = log.with_suffix(".argv")
    if not path.is_file():
        return []
    args = [a.decode() for a in path.read_bytes().split(b"\0")[:-1]]
    return args[args.index(TRAINER_MODULE) + 1 :]


def as_placeholders(argv: list[str], paths: dict[str, str], bridge: str, engine: str) -> list[str]:
    """``argv`` with this run's paths, bridge and engine written as the suite's placeholders (``{model}``,
    ``{vanilla_mbridge}``, ``{engine}``, ...), so one recorded list stands for every run of the harness."""
    out = []
    for arg in argv:
        for name, path in sorted(paths.items(), key=lambda item: -len(item[1])):
            arg = arg.replace(path, "{" + name + "}")
        key, has_value, value = arg.partition("=")
        if has_value and key.endswith(".vanilla_mbridge") and value == str(bridge == "mbridge"):
            arg = f"{key}={{vanilla_mbridge}}"
        elif has_value and key.endswith("rollout.name") and value == engine:
            arg = f"{key}={{engine}}"
        out.append(arg)
    return out


def _recorded_differences(argv: list[str]) -> list[str]:
    """What the suite's recorded command line lacks or has beyond ``argv`` (both with placeholders)."""
    if E2E_COMMIT != PINNED_COMMIT:
        return [f"the suite's list was recorded at {E2E_COMMIT[:9]}, this run used {PINNED_COMMIT[:9]}"]
    missing = [a for a in argv if a not in E2E_ARGV]
    extra = [a for a in E2E_ARGV if a not in argv]
    return [f"not in the suite's list: {a}" for a in missing] + [f"only in the suite's list: {a}" for a in extra]


def _step_metrics(ckpt: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: {k: v for k, v in row.items() if not k.startswith("timing_s/") and k not in CLOCKS} for row in rows}


def _hf_differences(a: Path, b: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict:
        out: dict = {}
        for file in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(file)))
        return out

    left, right = weights(a), weights(b)
    if sorted(left) != sorted(right) or not left:
        return [f"tensor names differ ({len(left)} vs {len(right)})"]
    return [name for name in left if not torch.equal(left[name], right[name])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", nargs="?", help="upstream verl's git dir (else $VERL_UPSTREAM_GIT_DIR)")
    parser.add_argument("--bridge", choices=("megatron-bridge", "mbridge"), default="megatron-bridge")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the script's ENGINE: the rollout (upstream's default is vllm)")
    parser.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    git_dir = resolve_git_dir(args.git_dir)
    work = Path(args.keep or tempfile.mkdtemp(prefix="upstream-e2e-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    script = work / Path(SCRIPT).name
    exported = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{PINNED_COMMIT}:{SCRIPT}"], capture_output=True)
    if exported.returncode != 0:
        print(f"{SCRIPT} not found at {PINNED_COMMIT} in {git_dir}: pass upstream verl's git dir", file=sys.stderr)
        return 2
    script.write_bytes(exported.stdout)
    print(f"[upstream-e2e] {SCRIPT} at {PINNED_COMMIT[:9]} -> {script}", flush=True)
    env = _environment(work, args.bridge, args.engine, steps=2)
    whole, resumed = work / "whole", work / "resumed"
    for stale in (whole, resumed):  # a kept directory's earlier runs are never compared
        shutil.rmtree(stale, ignore_errors=True)
    common = ["reward.reward_model.enable=False", "trainer.logger=[console,file]"]
    failures = []
    if _run(script, env, [*common, f"trainer.default_local_dir={whole}"], work / "run1.log") != 0:
        failures.append(f"run 1 failed: {work / 'run1.log'}")
    argv = recorded_argv(work / "run1.log")
    paths = {"model": env["MODEL_PATH"], "data": env["TRAIN_FILES"], "ckpt": str(whole), "work": str(work)}
    if len(env.get("HOME", "")) > 1:  # the script's own defaults under ${HOME} (paths it never reads here)
        paths["home"] = env["HOME"]
    drift = _recorded_differences(as_placeholders(argv, paths, args.bridge, args.engine)) if argv else ["the script ran no trainer"]
    if not drift:
        print(f"[upstream-e2e] the script's {len(argv)} trainer arguments (ENGINE={args.engine}) are the suite's recorded list", flush=True)
    if not failures:
        resume = {**env, "RESUME_MODE": "resume_path"}
        extra = [*common, f"trainer.default_local_dir={resumed}", f"trainer.resume_from_path={whole}/global_step_1"]
        if _run(script, resume, extra, work / "run2.log") != 0:
            failures.append(f"run 2 (resumed from step 1) failed: {work / 'run2.log'}")
    if not failures:
        first, again = _step_metrics(whole), _step_metrics(resumed)
        if sorted(first) != [1, 2] or sorted(again) != [2]:
            failures.append(f"steps logged: run 1 {sorted(first)}, run 2 {sorted(again)} (expected [1, 2] and [2])")
        elif first[2] != again[2]:
            differ = sorted(k for k in first[2].keys() | again[2].keys() if first[2].get(k) != again[2].get(k))
            failures.append(f"step 2 differs after the resume in {differ}")
        else:
            bridge = first[2].get("bridge")
            print(f"[upstream-e2e] step 2 repeated exactly after the resume ({len(first[2])} metrics; bridge {bridge})")
        hf = "global_step_2/actor/model/huggingface"
        if not failures and (differences := _hf_differences(whole / hf, resumed / hf)):
            failures.append(f"the step-2 HF exports differ: {differences[:5]}")
    failures += [f"the script's command line: {line}" for line in drift]
    for failure in failures:
        print(f"[upstream-e2e] FAILED: {failure}", file=sys.stderr)
    if not failures and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
