"""Run a frozen list of upstream verl's own tests against THIS package and report per file.

    python interop/upstream_tests.py {ckpt,cpu} [GIT_DIR | --git-dir DIR] [--json OUT] [--timeout S]
        [--only SUBSTRING ...] [pytest args...]

(``interop/run_upstream_ckpt_tests.sh`` and ``interop/run_upstream_cpu_tests.sh`` run it with this repository's
``.venv`` python.) The upstream git directory (bare or a checkout) comes from the argument or
``$VERL_UPSTREAM_GIT_DIR``; there is no default, and nothing is fetched. Upstream's ``tests/`` tree at the pinned commit is exported into a
temporary directory outside this repository (removed afterwards; ``KEEP_UPSTREAM_TESTS=1`` keeps it) and each
file runs in its own pytest process with this interpreter and this repository first on ``PYTHONPATH``, so one
file that hangs, crashes or cannot be imported does not hide another's results. Each failure is classed from
its error text (see ``classify``); docs/upstream-interop.md records the classes after review.

Suites (frozen; see docs/upstream-interop.md for how the ``cpu`` list was drawn):
  ckpt  upstream's checkpoint-layer CPU tests, one test deselected (PEFT, refused by design)
  cpu   every upstream ``*_on_cpu.py`` test file that imports a module this package has at the same path,
        four tests of upstream's config file layout deselected (``CPU_DESELECT``)

Exit status: 0 when every collected test passed (skips allowed), 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

PINNED_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
REPO = Path(__file__).resolve().parent.parent

CKPT_FILES = (
    "tests/utils/ckpt/test_megatron_checkpoint_manager_on_cpu.py",
    "tests/utils/ckpt/test_checkpoint_cleanup_on_cpu.py",
    "tests/utils/ckpt/test_esi_save_ckpt_on_cpu.py",  # should_save_ckpt_esi
)
# Drawn 2026-12-01 at PINNED_COMMIT and frozen: removing or renaming a name here does not shrink it.
CPU_FILES = (
    "tests/checkpoint_engine/test_fsdp_lora_only_checkpoint_on_cpu.py",
    "tests/experimental/agent_loop/test_agent_loop_extra_fields_schema_on_cpu.py",
    "tests/model_merger/test_output_validation_on_cpu.py",
    "tests/single_controller/test_auto_padding_on_cpu.py",
    "tests/single_controller/test_decorator_on_cpu.py",
    "tests/single_controller/test_fused_workers_on_cpu.py",
    "tests/single_controller/test_ray_local_envs_on_cpu.py",
    "tests/test_base_config_on_cpu.py",
    "tests/test_protocol_on_cpu.py",
    "tests/test_protocol_v2_on_cpu.py",
    "tests/tools/test_mixed_tools_on_cpu.py",
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_metric_utils_on_cpu.py",
    "tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py",
    "tests/trainer/ppo/test_spec_decode_metrics_on_cpu.py",
    "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
    "tests/trainer/ppo/v1/test_reissue_inflight_on_cpu.py",
    "tests/trainer/ppo/v1/test_separate_async_step_switch_on_cpu.py",
    "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
    *CKPT_FILES[1:],
    "tests/utils/ckpt/test_lora_custom_object_save_on_cpu.py",
    *CKPT_FILES[:1],
    "tests/utils/dataset/test_multiturn_sft_dataset_on_cpu.py",
    "tests/utils/dataset/test_rl_collate_fn_on_cpu.py",
    "tests/utils/dataset/test_rl_dataset_on_cpu.py",
    "tests/utils/megatron/test_muon_layerwise_bridge_ddp_on_cpu.py",
    "tests/utils/megatron/test_muon_optim_realcfg_on_cpu.py",
    "tests/utils/megatron/test_muon_optim_wiring_on_cpu.py",
    "tests/utils/megatron/test_router_replay_model_walk_on_cpu.py",
    "tests/utils/reward_score/test_sandbox_on_cpu.py",
    "tests/utils/test_audio_input_support_on_cpu.py",
    "tests/utils/test_config_on_cpu.py",
    "tests/utils/test_fs_on_cpu.py",
    "tests/utils/test_fsdp2_model_transfer_on_cpu.py",
    "tests/utils/test_rl_insight_logger_on_cpu.py",
    "tests/utils/test_tracking_on_cpu.py",
    "tests/utils/test_transferqueue_utils_on_cpu.py",
    "tests/workers/config/test_actor_config_on_cpu.py",
    "tests/workers/config/test_critic_config_on_cpu.py",
    "tests/workers/config/test_optim_config_on_cpu.py",
    # added 2026-12-05, once the typed configs they import existed (the rest of upstream's tests/workers/config/)
    "tests/workers/config/test_engine_config_on_cpu.py",
    "tests/workers/config/test_model_config_on_cpu.py",
    "tests/workers/rollout/rollout_vllm/test_mtp_hybrid_sleep_acceptance_on_cpu.py",
    "tests/workers/rollout/test_llm_server_response_length_cap_on_cpu.py",
    "tests/workers/rollout/test_llm_server_routed_experts_on_cpu.py",
    "tests/workers/rollout/test_vllm_pd_disaggregation_on_cpu.py",
    "tests/workers/test_distillation_topk_symmetry_on_cpu.py",
    "tests/workers/test_engine_return_model_output_on_cpu.py",
    "tests/workers/test_engine_workers_mini_batch_trace_on_cpu.py",
)
# Tests of features this package refuses by design (docs/upstream-interop.md says why).
CKPT_DESELECT = (
    "tests/utils/ckpt/test_megatron_checkpoint_manager_on_cpu.py"
    "::TestSaveCheckpointDispatch::test_peft_adapters_under_model_subdir",
)
# Tests of upstream's config file layout, which this package does not have (its trainer reads one YAML file,
# ppo_megatron_trainer.yaml); the typed configs they would build are tested by the files' other tests.
_ROLE_YAML = "upstream's per-role Hydra config group verl/trainer/config/actor/*.yaml (not here: one YAML file)"
CPU_DESELECT = {
    "tests/utils/test_config_on_cpu.py::TestPrintCfgCommand::test_command_with_override": (
        "upstream's scripts/print_cfg.py composing upstream's ppo_trainer.yaml (FSDP trainer; not in this package)"
    ),
    "tests/workers/config/test_actor_config_on_cpu.py::TestActorConfig::test_actor_config_from_yaml": _ROLE_YAML,
    "tests/workers/config/test_actor_config_on_cpu.py::TestActorConfig::test_fsdp_actor_config_from_yaml": _ROLE_YAML,
    "tests/workers/config/test_actor_config_on_cpu.py::TestActorConfig::test_megatron_actor_config_from_yaml": _ROLE_YAML,
}
SUITES = {"ckpt": (CKPT_FILES, CKPT_DESELECT), "cpu": (CPU_FILES, tuple(CPU_DESELECT))}
# Failures expected by design (the feature is refused here with a one-line error): reported as "refused".
REFUSED = {
    CKPT_DESELECT[0]: "PEFT adapters (peft_cls is refused)",
    "tests/utils/megatron/test_muon_optim_wiring_on_cpu.py::test_muon_fields_forwarded": "Muon (refused)",
    "tests/utils/megatron/test_muon_optim_wiring_on_cpu.py::test_only_supported_muon_fields_forwarded": "Muon (refused)",
    "tests/utils/megatron/test_muon_optim_realcfg_on_cpu.py::test_verl_wiring_builds_real_megatron_muon_config": (
        "Muon (refused)"
    ),
}

# Error text -> class. "absent": the test needs a verl name (module, attribute) this package does not have;
# "dependency": a third-party package not installed here; "signature": a shared callable refuses upstream's
# arguments; everything else is "review" until a person has read it (docs/upstream-interop.md).
_ABSENT = (
    re.compile(r"No module named '(verl[\w.]*)'"),
    re.compile(r"cannot import name '(\w+)' from '(verl[\w.]*)'"),
    re.compile(r"module '(verl[\w.]*)' has no attribute '(\w+)'"),
    re.compile(r"<module '(verl[\w.]*)' from [^>]*> has no attribute '(\w+)'"),
    re.compile(r"'(\w+)' object has no attribute '(\w+)'"),
    re.compile(r"type object '(\w+)' has no attribute '(\w+)'"),
)
# Owners in "'X' object has no attribute" that are not this package's: such a failure needs a person's look.
_NOT_VERL_OWNERS = {"NoneType", "str", "int", "float", "bool", "list", "dict", "tuple", "Tensor", "MagicMock", "Mock"}
_DEPENDENCY = re.compile(r"No module named '([\w.]+)'")
_SIGNATURE = re.compile(r"([\w.<>]+\(\)) (?:got an unexpected keyword argument|missing \d+ required) [^\n]*")


def classify(text: str) -> tuple[str, str]:
    """The class of one failure and the name it turns on, from the traceback text."""
    for pattern in _ABSENT:
        match = pattern.search(text)
        if match and match.group(1) not in _NOT_VERL_OWNERS:
            groups = match.groups()
            if len(groups) == 1:
                return "absent", groups[0]
            # "cannot import name X from M" gives (X, M); the attribute patterns give (owner, attribute)
            return "absent", f"{groups[1]}.{groups[0]}" if pattern is _ABSENT[1] else f"{groups[0]}.{groups[1]}"
    match = _DEPENDENCY.search(text)
    if match:
        return "dependency", match.group(1)
    match = _SIGNATURE.search(text)
    if match:
        return "signature", match.group(0).strip()
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return "review", lines[0][:200] if lines else text.strip().splitlines()[-1][:200] if text.strip() else ""


@dataclass
class FileResult:
    path: str
    collected: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    collection_error: bool = False
    timed_out: bool = False
    failures: list[dict] = field(default_factory=list)


def _refuse(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    sys.exit(2)


def resolve_git_dir(given: str | None) -> Path:
    """The upstream git dir holding PINNED_COMMIT, or a one-line refusal."""
    source = given or os.environ.get("VERL_UPSTREAM_GIT_DIR")
    if not source:
        _refuse("no upstream git dir: pass --git-dir DIR (or the first argument) or set VERL_UPSTREAM_GIT_DIR")
    for args in (["--git-dir", source], ["-C", source]):
        probe = subprocess.run(["git", *args, "rev-parse", "--absolute-git-dir"], capture_output=True, text=True)
        if probe.returncode != 0:
            continue
        git_dir = Path(probe.stdout.strip())
        has = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "-e", f"{PINNED_COMMIT}^{{commit}}"])
        if has.returncode == 0:
            return git_dir
    _refuse(f"commit {PINNED_COMMIT} not found in git dir {source!r}: pass upstream verl's git dir")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _test_id(path: str, case: ET.Element) -> str:
    """``path::Class::name`` from a junit case (its classname is the dotted module path, then the classes)."""
    module = path[: -len(".py")].replace("/", ".")
    classes = case.get("classname", "")[len(module) + 1 :].replace(".", "::")
    return "::".join(part for part in (path, classes, case.get("name", "")) if part)


def _absent_imports(work: Path, path: str) -> list[str]:
    """The ``verl`` names a test file imports at its top level that this package lacks (a collection error
    names only the first; a file that fails on a missing third-party package needs these too)."""
    probe = (
        "import ast, importlib, sys\n"
        "tree = ast.parse(open(sys.argv[1]).read())\n"
        "for node in tree.body:\n"
        "    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or '').split('.')[0] == 'verl':\n"
        "        try:\n"
        "            mod = importlib.import_module(node.module)\n"
        "        except ModuleNotFoundError as e:\n"
        "            print(e.name if (e.name or '').startswith('verl') else node.module + ' (needs ' + str(e.name) + ')')\n"
        "            continue\n"
        "        except Exception as e:\n"
        "            print(node.module + ' (' + type(e).__name__ + ')')\n"
        "            continue\n"
        "        for alias in node.names:\n"
        "            if not hasattr(mod, alias.name):\n"
        "                try:\n"
        "                    importlib.import_module(node.module + '.' + alias.name)\n"
        "                except Exception:\n"
        "                    print(node.module + '.' + alias.name)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", probe, path], cwd=work, env=env, capture_output=True, text=True)
    return sorted(set(out.stdout.split("\n")) - {""})


def parse_junit(path: Path, result: FileResult) -> None:
    """Fill ``result`` from one pytest junit file (a collection error is one <error> case named after the file)."""
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None and problem is None:
            result.collected += 1
            result.skipped += 1
            continue
        if problem is not None and (problem.get("message") or "").startswith("collection failure"):
            result.collection_error = True
            klass, name = classify(problem.text or "")
            result.failures.append({"test": "<collection>", "class": klass, "name": name})
            continue
        result.collected += 1
        if problem is None:
            result.passed += 1
            continue
        result.failed += 1
        test_id = _test_id(result.path, case)
        if test_id in REFUSED:
            klass, name = "refused", REFUSED[test_id]
        else:
            klass, name = classify((problem.get("message") or "") + "\n" + (problem.text or ""))
        result.failures.append({"test": test_id.split("::", 1)[1], "class": klass, "name": name})


def run_file(work: Path, path: str, deselect: tuple[str, ...], extra: list[str], timeout: float) -> FileResult:
    result = FileResult(path)
    junit = work / "junit" / (path.replace("/", "__") + ".xml")
    junit.parent.mkdir(exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--rootdir={work}",
           "-W", "ignore::UserWarning", "-W", "ignore::DeprecationWarning", "-W", "ignore::FutureWarning",
           f"--junitxml={junit}", *[f"--deselect={t}" for t in deselect if t.startswith(path + "::")], *extra, path]
    log = work / "logs" / (path.replace("/", "__") + ".log")
    log.parent.mkdir(exist_ok=True)
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            result.timed_out = True
    if junit.exists():
        parse_junit(junit, result)
        for failure in result.failures:
            if failure["test"] == "<collection>":
                # the error names the first missing import only; list every one the file needs
                failure["absent"] = _absent_imports(work, path)
    elif not result.timed_out:
        result.collection_error = True
        result.failures.append({"test": "<no report>", "class": "review", "name": log.read_text()[-200:]})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("git_dir_arg", nargs="?", metavar="GIT_DIR", help="upstream verl's git dir (or --git-dir)")
    parser.add_argument("--git-dir", help="upstream verl's git dir (default $VERL_UPSTREAM_GIT_DIR)")
    parser.add_argument("--json", type=Path, help="write the per-file results here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per file (default 600)")
    parser.add_argument("--only", action="append", default=[], help="run only listed files containing this")
    args, extra = parser.parse_known_args()
    git_dir = resolve_git_dir(args.git_dir or args.git_dir_arg)
    files, deselect = SUITES[args.suite]
    if args.only:
        files = tuple(f for f in files if any(part in f for part in args.only))
        if not files:
            _refuse(f"--only {args.only} matches no file of suite {args.suite}")

    if Path(tempfile.gettempdir()).resolve().is_relative_to(REPO):
        _refuse(f"the temporary directory {tempfile.gettempdir()} lies inside the repository; set TMPDIR elsewhere")
    work = Path(tempfile.mkdtemp(prefix=f"verl-upstream-{args.suite}-tests."))
    try:
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", PINNED_COMMIT, "tests"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
        print(f"upstream tests at {PINNED_COMMIT[:9]} from {git_dir} -> {work}")
        print(f"package under test: {REPO / 'verl'} (python: {sys.executable})")
        results = []
        for path in files:
            res = run_file(work, path, deselect, extra, args.timeout)
            results.append(res)
            flag = " TIMEOUT" if res.timed_out else " COLLECTION-ERROR" if res.collection_error else ""
            print(f"{path}: collected {res.collected}, passed {res.passed}, failed {res.failed}, "
                  f"skipped {res.skipped}{flag}", flush=True)
            for failure in res.failures:
                print(f"    {failure['class']:<10} {failure['test']}: {failure['name']}")
                if failure.get("absent"):
                    print(f"        imports this package lacks: {', '.join(failure['absent'])}")
        total = {k: sum(getattr(r, k) for r in results) for k in ("collected", "passed", "failed", "skipped")}
        broken = sum(r.collection_error or r.timed_out for r in results)
        print(f"TOTAL {len(results)} files: collected {total['collected']}, passed {total['passed']}, "
              f"failed {total['failed']}, skipped {total['skipped']}, files not collected/timed out {broken}")
        if args.json:
            args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))
        return 0 if total["failed"] == 0 and broken == 0 else 1
    finally:
        if os.environ.get("KEEP_UPSTREAM_TESTS") == "1":
            print(f"keeping {work}")
        else:
            subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    sys.exit(main())
