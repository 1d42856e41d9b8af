"""Upstream verl's Megatron launch scripts against this trainer's command line, key by key.

    python -m interop.upstream_launch_scripts UPSTREAM_GIT_DIR [--commit C] [--json OUT]   (from the repository root)

Each ``examples/**/*megatron*.sh`` that starts ``verl.trainer.main_ppo`` is run from an export of the upstream
commit with its defaults, but every launcher it could call (python, uv, ray, torchrun, pip, nvidia-smi, the HF
download tools, ...) is a stub on PATH that records the trainer's command line and starts nothing. Each recorded
override then goes through main_ppo's own pre-Hydra check (``verl.trainer.cli_overrides``): it composes, or it is
refused in one line naming it. A Hydra traceback, or an override refused without its key in the line, is a
failure. Prints one line per script and exits 1 on any failure, 2 on bad input. Not part of CI (it needs the
upstream checkout); docs/upstream-interop.md has its latest result.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

from hydra import compose, initialize_config_module

from interop.upstream_tests import PINNED_COMMIT
from verl.trainer.cli_overrides import CONFIG_MODULE, CONFIG_NAME, config_arguments, override_key, override_problems
from verl.trainer.validation import check_config

TRAINER_MODULE = "verl.trainer.main_ppo"
STUBBED = ("python", "python3", "uv", "ray", "torchrun", "pip", "pip3", "nvidia-smi", "npu-smi", "huggingface-cli", "hf",
           "wget", "curl", "git", "modelscope", "sleep")  # fmt: skip
# The stub: a trainer command line is written NUL-separated into $CAPTURE_DIR; `python -c` fails (no accelerator
# package is importable, so the scripts take their GPU branch); everything else succeeds silently.
STUB = f"""#!/bin/bash
for arg in "$@"; do
  if [ "$arg" = "{TRAINER_MODULE}" ]; then
    printf '%s\\0' "$@" > "$CAPTURE_DIR/$(date +%s%N)"
    exit 0
  fi
done
[ "$1" = "-c" ] && exit 1
exit 0
"""
# Paths some scripts require the user to set (they stop on `set -u` otherwise).
USER_PATHS = ("HDFS_ROOT", "RAY_DATA_HOME", "DATA_ROOT", "KIMI_K2_6_MODEL_PATH")


def export_scripts(git_dir: str, commit: str, into: pathlib.Path) -> list[pathlib.Path]:
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit, "examples"], check=True, capture_output=True).stdout
    archive_path = into / "examples.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(into, filter="data")
    scripts = sorted(into.glob("examples/**/*megatron*.sh"))
    return [s for s in scripts if TRAINER_MODULE in s.read_text(errors="replace")]


def trainer_arguments(script: pathlib.Path, stubs: pathlib.Path, home: pathlib.Path) -> list[list[str]]:
    """The trainer command lines the script runs with its defaults (after the module name)."""
    capture = pathlib.Path(tempfile.mkdtemp(dir=home))
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(home), "CAPTURE_DIR": str(capture), "LANG": "C.UTF-8"}
    env.update({name: str(home / name.lower()) for name in USER_PATHS})
    (script.parent / "logs").mkdir(exist_ok=True)  # scripts that tee into ./logs expect the user to have made it
    subprocess.run(["bash", script.name], cwd=script.parent, env=env, capture_output=True, timeout=60, check=False)
    runs = []
    for record in sorted(capture.iterdir()):
        args = record.read_bytes().split(b"\0")[:-1]
        decoded = [a.decode(errors="replace") for a in args]
        runs.append(decoded[decoded.index(TRAINER_MODULE) + 1 :])
    return runs


def judge(argv: list[str]) -> dict:
    """Every refusal line must name its key; the overrides that compose then go through the pre-start checks
    (``check_config``), which may refuse more in one line each but must not raise."""
    overrides, _, _ = config_arguments(argv)
    verdict = {"overrides": len(overrides), "refused": [], "unnamed": [], "pre_start": []}
    try:
        verdict["refused"] = override_problems(argv)
        kept = [o for o in overrides if not any(override_key(o) in line for line in verdict["refused"])]
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            config = compose(CONFIG_NAME, overrides=kept)
        verdict["pre_start"] = check_config(config, None)
    except Exception as err:  # a traceback instead of a line: the failure this harness exists to find
        verdict["unnamed"].append(f"{type(err).__name__}: {err}")
    verdict["unnamed"] += [p for p in verdict["refused"] if not any(override_key(o) in p for o in overrides)]
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("git_dir")
    parser.add_argument("--commit", default=PINNED_COMMIT)
    parser.add_argument("--json", help="write the per-script results here")
    args = parser.parse_args()
    if not os.path.isdir(args.git_dir):
        print(f"no git directory at {args.git_dir}: pass upstream verl's (bare or checkout)", file=sys.stderr)
        return 2
    results, failed = {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        stubs, home = root / "stubs", root / "home"
        stubs.mkdir()
        home.mkdir()
        for name in STUBBED:
            (stubs / name).write_text(STUB)
            (stubs / name).chmod(0o755)
        for script in export_scripts(args.git_dir, args.commit, root):
            name = str(script.relative_to(root))
            runs = trainer_arguments(script, stubs, home)
            if not runs:
                results[name] = {"error": "the script ran no trainer command with its defaults"}
                print(f"SKIP {name}: {results[name]['error']}")
                continue
            verdicts = [judge(run) for run in runs]
            results[name] = verdicts
            bad = [u for v in verdicts for u in v["unnamed"]]
            failed += bool(bad)
            refused = sorted({line for v in verdicts for line in v["refused"]})
            pre_start = sorted({line for v in verdicts for line in v["pre_start"]})
            print(
                f"{'FAIL' if bad else 'ok  '} {name}: {sum(v['overrides'] for v in verdicts)} overrides, {len(refused)} refused "
                f"by the command line, {len(pre_start)} lines from the pre-start checks"
                + "".join(f"\n       {line}" for line in refused + bad)
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
