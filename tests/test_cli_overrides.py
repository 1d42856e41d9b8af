"""main_ppo's command line: an override Hydra cannot compose is refused in one line naming it and the fix, every
such override at once, before Hydra prints its own multi-line report; and upstream's launch scripts are judged by
the same check (the interop harness, run here on a stand-in upstream repository)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from verl.trainer.cli_overrides import override_problems

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    ("argv", "names", "fix"),
    [
        (["actor_rollout_ref.actor.no_such_key=1"], "actor_rollout_ref.actor.no_such_key", "drop the override"),
        (["+trainer.nnodes=2"], "trainer.nnodes", "drop the leading '+'"),
        (["~trainer.no_such_key"], "trainer.no_such_key", "nothing to delete"),
        (["model_engine=no_such_engine"], "model_engine", "dp, megatron"),
        (["data.train_files=[a,"], "data.train_files=[a,", "quote the value"),
        (["--config-name=ppo_trainer", "trainer.nnodes=1"], "--config-name=ppo_trainer", "drop --config-name"),
    ],
)
def test_an_override_hydra_cannot_compose_is_one_line_naming_it_and_the_fix(argv, names, fix):
    problems = override_problems(argv)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert names in problems[0] and fix in problems[0]


def test_every_failing_override_is_named_not_only_the_first():
    problems = override_problems(["trainer.nnodes=1", "trainer.typo_one=1", "data.typo_two=2", "trainer.save_freq=3"])
    assert [p.split(" ")[0] for p in problems] == ["trainer.typo_one", "data.typo_two"]


def test_upstreams_config_path_and_valid_overrides_pass():
    assert override_problems(["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", "model_engine=megatron", "trainer.nnodes=1"]) == []


def test_a_config_of_the_users_own_is_left_to_hydra(tmp_path):
    assert override_problems([f"--config-path={tmp_path}", "--config-name=mine", "anything.at_all=1"]) == []


def test_the_command_line_exits_2_with_one_line_per_refused_override_and_no_hydra_report():
    run = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "actor_rollout_ref.actor.no_such_key=1", "+trainer.nnodes=2"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    refused = [line for line in run.stderr.splitlines() if line.startswith("  - ")]
    assert len(refused) == 2 and "no_such_key" in refused[0] and "trainer.nnodes" in refused[1]
    assert "HYDRA_FULL_ERROR" not in run.stderr + run.stdout


def _stand_in_upstream(tmp_path) -> str:
    """A git repository shaped like upstream's, with two Megatron launch scripts in upstream's styles."""
    repo = tmp_path / "upstream"
    (repo / "examples" / "grpo_trainer").mkdir(parents=True)
    (repo / "examples" / "grpo_trainer" / "run_tiny_megatron.sh").write_text(textwrap.dedent("""\
        set -xeuo pipefail
        DEVICE=$(python3 -c "import torch_npu" && echo npu || echo gpu)
        ACTOR=(actor_rollout_ref.actor.ppo_mini_batch_size=${MINI:-4} actor_rollout_ref.actor.no_such_key=1)
        python3 -m verl.trainer.main_ppo model_engine=megatron "${ACTOR[@]}" trainer.device=cuda "$@"
        """))  # fmt: skip
    (repo / "examples" / "grpo_trainer" / "run_job_megatron.sh").write_text(textwrap.dedent("""\
        ray job submit --address=http://127.0.0.1:8265 -- python3 -m verl.trainer.main_ppo \\
            --config-path=config --config-name='ppo_megatron_trainer.yaml' trainer.nnodes=1
        """))  # fmt: skip
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "scripts"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    return str(repo / ".git")


def test_the_launch_script_harness_runs_each_script_through_the_command_lines_check(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "interop.upstream_launch_scripts", _stand_in_upstream(tmp_path), "--commit", "HEAD"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {line.split()[1].rstrip(":"): line for line in run.stdout.splitlines() if line.startswith("ok")}
    assert "examples/grpo_trainer/run_tiny_megatron.sh" in lines and "examples/grpo_trainer/run_job_megatron.sh" in lines
    assert "4 overrides, 1 refused" in lines["examples/grpo_trainer/run_tiny_megatron.sh"]
    assert "actor_rollout_ref.actor.no_such_key is not in this trainer's config" in run.stdout
    assert "1 overrides, 0 refused" in lines["examples/grpo_trainer/run_job_megatron.sh"]
