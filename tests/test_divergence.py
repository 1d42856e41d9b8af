"""A diverged model is named as such: the first NaN/Inf among what a step has in hand (the rollout's and the
actor's logits, the loss, the grad norm), the step, and the committed checkpoint to resume; nothing of the
diverged step is saved. Through the CLI with ``optim.lr=1e30`` (it failed at the next rollout with torch's
"probability tensor contains either inf, nan or element < 0")."""

import json
import math
import re

import pytest
import torch

from tests.cli_runs import TRACKER, run_trainer, two_ranks_ep2
from verl.utils.checkpoint.finite import DivergedError, check_step_is_finite, first_non_finite_quantity


def _committed_steps(root, steps: list[int], tracked: int) -> None:
    """Steps a resume could take (an actor directory with its contents file), and the tracker."""
    for step in steps:
        (root / f"global_step_{step}" / "actor").mkdir(parents=True)
        (root / f"global_step_{step}" / "actor" / "ckpt_contents.json").write_text(json.dumps({"contents": {}}))
    (root / TRACKER).write_text(str(tracked))


def test_the_first_non_finite_quantity_is_named_with_the_checkpoint_to_resume(tmp_path):
    quantities = {"the loss": [1.5, 2.0], "the grad norm": [3.0, math.inf], "the logits": torch.tensor([math.nan])}
    assert first_non_finite_quantity(quantities) == "the grad norm"
    assert first_non_finite_quantity({"counts": torch.tensor([1, 2]), "empty": torch.empty(0)}) is None
    check_step_is_finite(4, {"the loss": [0.5]}, str(tmp_path))  # finite: nothing happens
    with pytest.raises(DivergedError, match="diverged at step 1: the grad norm holds NaN or Inf; nothing of step 1 is saved. It came from the initial .* no committed checkpoint before them is kept: start again"):
        check_step_is_finite(1, quantities, str(tmp_path))
    # Step 4 found it: step 3's update made the weights global_step_3 holds; 2 is newest before, 5 is not committed.
    _committed_steps(tmp_path, [1, 2, 3, 5], tracked=3)
    with pytest.raises(DivergedError) as diverged:
        check_step_is_finite(4, quantities, str(tmp_path))
    assert f"It came from the weights of step 3's update, which {tmp_path}/global_step_3 holds (do not resume it); the previous checkpoint, {tmp_path}/global_step_2 (step 2), is the one to resume: trainer.resume_mode=resume_path trainer.resume_from_path={tmp_path}/global_step_2, with a lower actor_rollout_ref.actor.optim.lr" in str(diverged.value)


def test_a_learning_rate_of_1e30_is_reported_as_divergence_through_the_cli(tmp_path, env, tiny_moe_path):
    ckpt = tmp_path / "ckpt"
    code, out = run_trainer(
        [*two_ranks_ep2(tiny_moe_path, ckpt), "actor_rollout_ref.actor.optim.lr=1e30", "trainer.total_training_steps=4"],
        tmp_path, env, timeout_s=540,
    )  # fmt: skip
    assert code == 1, out[-5000:]
    lines = [line for line in out.splitlines() if line.startswith("[main_ppo] training stopped: the model diverged at step ")]
    assert len(lines) == 1, out[-5000:]
    line = lines[0]
    step = int(re.search(r"diverged at step (\d+)", line).group(1))
    committed = int((ckpt / TRACKER).read_text())
    assert committed == step - 1, line  # saved after the update that blew the weights up (huge, still finite)
    assert f"It came from the weights of step {committed}'s update, which {ckpt}/global_step_{committed} holds (do not resume it)" in line, line
    if committed == 1:
        assert "no committed checkpoint before them is kept: start again" in line, line
    else:
        assert f"the previous checkpoint, {ckpt}/global_step_{committed - 1} (step {committed - 1}), is the one to resume" in line, line
    assert re.search(r"diverged at step \d+: the (rollout's logits|actor's logits|policy loss|grad norm)", line), line
    assert "probability tensor" not in out and "training failed" not in out, out[-5000:]
    assert not (ckpt / f"global_step_{step}" / "actor").exists(), "a step of the diverged model was saved"
