"""A weight sync that goes wrong after the first batch is caught, each way on its own.

One rank builds the actor and the HF rollout and syncs the actor's weights into the rollout the way every step does,
then three times more: faithfully, with two experts' weights swapped under their names, and with one expert tensor
left out. A swap keeps every name and shape, so the sync's own accounting passes it and only the log-prob check (the
trainer's, on every step) stops it; a tensor left out is named by the sync itself, and the rollout that kept its
stale slot is stopped by the log-prob check as well.
"""

import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

RESPONSE_LEN = 8
TOLERANCES = {"float32": 1e-4}  # the YAML's float32 tolerance of the parity check
SWAPPED = ("model.layers.1.mlp.experts.2.", "model.layers.1.mlp.experts.5.")
DROPPED = "model.layers.2.mlp.experts.3.down_proj.weight"


def _swap_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    first, second = SWAPPED
    swapped = dict(weights)
    for name in weights:
        if name.startswith(first):
            twin = second + name.removeprefix(first)
            swapped[name], swapped[twin] = weights[twin], weights[name]
    return swapped


def _syncs(model_path: str) -> dict:
    from verl.models.mcore.forward import compute_log_probs
    from verl.models.mcore.parallel_hf_save import gather_hf_weights
    from verl.trainer.ppo.log_prob_parity import max_log_prob_diff
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings

    actor = MegatronEngine(*actor_configs(model_path, total_training_steps=TRAINING_STEPS))
    tok = actor.tokenizer
    prompts = torch.randint(4, 99, (8, 4), generator=torch.Generator().manual_seed(3))
    weights = gather_hf_weights(actor.bridge, actor.model, receivers=[0])

    def sync_and_compare(sent: dict[str, torch.Tensor]) -> dict:
        torch.manual_seed(17)  # a fresh rollout's own initial weights: what a slot the sync missed keeps
        rollout = InMemoryHFRollout(actor.hf_config, RolloutSettings(RESPONSE_LEN), tok.eos_token_id, tok.pad_token_id)
        refused = None
        try:
            rollout.load_weights(sent.items())
        except KeyError as err:
            refused = str(err)
        out = rollout.generate_sequences(prompts, seed=5)
        sequences = torch.cat([prompts, out["responses"]], dim=1)
        megatron = compute_log_probs(actor.model, sequences, RESPONSE_LEN, 1.0, 4)
        return {"refused": refused, "max_diff": max_log_prob_diff(megatron, out["rollout_log_probs"], out["response_mask"])}

    assert any(name.startswith(SWAPPED[0]) for name in weights) and DROPPED in weights, sorted(weights)[:8]
    return {
        "faithful": sync_and_compare(weights),
        "swapped": sync_and_compare(_swap_experts(weights)),
        "dropped": sync_and_compare({name: tensor for name, tensor in weights.items() if name != DROPPED}),
    }


@pytest.fixture(scope="module")
def syncs(tiny_moe_path) -> dict:
    return run_on_ranks(_syncs, 1, ParallelSizes(), args=(tiny_moe_path,), timeout_s=300)[0]


def _step_check(max_diff: float) -> str | None:
    from verl.trainer.ppo.log_prob_parity import LogProbParityError, check_log_prob_parity

    try:
        check_log_prob_parity(max_diff, "float32", TOLERANCES, step=7)
    except LogProbParityError as err:
        return str(err)
    return None


def test_a_faithful_sync_passes_both_checks(syncs):
    assert syncs["faithful"]["refused"] is None
    assert _step_check(syncs["faithful"]["max_diff"]) is None


def test_two_swapped_experts_pass_the_name_check_and_are_stopped_by_the_log_prob_check(syncs):
    assert syncs["swapped"]["refused"] is None  # every name once, every shape right
    message = _step_check(syncs["swapped"]["max_diff"])
    assert message is not None and message.startswith("log-prob parity on step 7:"), message
    assert "misplaced a tensor" in message and "every_step=False" in message


def test_a_dropped_expert_tensor_is_named_by_the_sync_and_stopped_by_the_log_prob_check(syncs):
    assert syncs["dropped"]["refused"] is not None and DROPPED in syncs["dropped"]["refused"]
    assert _step_check(syncs["dropped"]["max_diff"]) is not None
