"""A weight sync that goes wrong after the first batch is caught, each way on its own, for both rollouts.

For each MoE family (the embedded Qwen3-MoE; Qwen2-MoE with shared experts and q/k/v biases, at head size 32,
which vLLM's CPU attention takes), one rank builds the actor and syncs its weights into each rollout (hf, vllm)
the way every step does, three times: faithfully, with two experts' weights swapped under their names, and with
one expert tensor left out. A swap keeps every name and shape, so the sync's own accounting passes it and only
the log-prob check (the trainer's, on every step) stops it; a tensor left out is named by the sync itself, and
the rollout that kept its stale slot is stopped by the log-prob check as well. The vLLM engine also refuses a
tensor sent twice, naming it, while a faithful sync of Qwen2-MoE's q/k/v biases (which vLLM's reload loads
and then replays when their layer completes) passes.

Each case starts from a rollout whose weights are not the actor's (hf: a fresh model's own initialisation; vllm:
the engine after a sync of a previous step's weights), so a slot the sync misses shows in the log-probs (vLLM's
reload processes the layer short of a tensor with that slot uninitialised).
"""

import importlib.util

import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs
from verl.models.tiny import make_tiny_hf_model
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

RESPONSE_LEN = 8
TOLERANCES = {"float32": 1e-4}  # the YAML's float32 tolerance of the parity check
SWAPPED = ("model.layers.1.mlp.experts.2.", "model.layers.1.mlp.experts.5.")
DROPPED = "model.layers.2.mlp.experts.3.down_proj.weight"
# The tiny models' builders (verl/models/tiny.py) per family: Qwen2-MoE leaves head_dim to hidden_size / heads,
# 16 at the tiny default, which vLLM's CPU attention does not take; two heads of 32 instead.
FAMILIES = {
    "qwen3_moe": {"kind": "moe"},
    "qwen2_moe_shared": {"kind": "qwen2_moe", "num_attention_heads": 2, "num_key_value_heads": 1},
}
TWICE = {"qwen3_moe": "model.layers.0.self_attn.k_proj.weight", "qwen2_moe_shared": "model.layers.0.self_attn.k_proj.bias"}
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
ROLLOUTS = ("hf", pytest.param("vllm", marks=pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed (the main leg has it)")))


def _swap_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    first, second = SWAPPED
    swapped = dict(weights)
    for name in weights:
        if name.startswith(first):
            twin = second + name.removeprefix(first)
            swapped[name], swapped[twin] = weights[twin], weights[name]
    return swapped


def _syncs(model_path: str, twice: str) -> dict:
    """On the one rank: each rollout's refusal (None: the sync passed) and log-prob gap to Megatron's per case."""
    from verl.models.mcore.forward import compute_log_probs
    from verl.models.mcore.parallel_hf_save import gather_hf_weights
    from verl.trainer.ppo.log_prob_parity import max_log_prob_diff
    from verl.workers.config import RolloutConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings
    from verl.workers.rollout.vllm_rollout import InMemoryVLLMRollout, WeightSyncError, join_engine_groups

    actor = MegatronEngine(*actor_configs(model_path, total_training_steps=TRAINING_STEPS))
    tok = actor.tokenizer
    prompts = torch.randint(4, 99, (8, 4), generator=torch.Generator().manual_seed(3))
    weights = gather_hf_weights(actor.bridge, actor.model, receivers=[0])
    assert any(name.startswith(SWAPPED[0]) for name in weights) and DROPPED in weights and twice in weights, sorted(weights)[:8]
    noise = torch.Generator().manual_seed(17)
    previous_step = {name: t + 0.05 * torch.randn(t.shape, generator=noise) for name, t in weights.items()}
    cases = {
        "faithful": weights,
        "swapped": _swap_experts(weights),
        "dropped": {name: tensor for name, tensor in weights.items() if name != DROPPED},
    }

    def compared(rollout, sent: dict[str, torch.Tensor] | list) -> dict:
        refused = None
        try:
            rollout.load_weights(sent.items() if isinstance(sent, dict) else sent)
        except (KeyError, WeightSyncError) as err:
            refused = str(err)
        out = rollout.generate_sequences(prompts, seed=5)
        sequences = torch.cat([prompts, out["responses"]], dim=1)
        megatron = compute_log_probs(actor.model, sequences, RESPONSE_LEN, 1.0, 4)
        return {"refused": refused, "max_diff": max_log_prob_diff(megatron, out["rollout_log_probs"], out["response_mask"])}

    def hf_rollout() -> InMemoryHFRollout:
        torch.manual_seed(17)  # a fresh rollout's own initial weights: what a slot the sync missed keeps
        return InMemoryHFRollout(actor.hf_config, RolloutSettings(RESPONSE_LEN), tok.eos_token_id, tok.pad_token_id)

    results = {"hf": {case: compared(hf_rollout(), sent) for case, sent in cases.items()}, "vllm": {}}
    if not VLLM_INSTALLED:
        return results
    join_engine_groups()
    engine = InMemoryVLLMRollout(
        model_path, actor.hf_config, RolloutSettings(RESPONSE_LEN), RolloutConfig(max_model_len=32, max_num_seqs=8, enforce_eager=True),
        tok.eos_token_id, tok.pad_token_id,
    )
    for case, sent in cases.items():
        engine.load_weights(previous_step.items())  # the step before: every slot holds other values than the actor's
        results["vllm"][case] = compared(engine, sent)
    items = list(weights.items())
    for where, at in (("next", [name for name, _ in items].index(twice) + 1), ("last", len(items))):
        engine.load_weights(previous_step.items())
        results["vllm"][f"duplicated_{where}"] = compared(engine, [*items[:at], (twice, weights[twice]), *items[at:]])
    return results


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def syncs(family, tmp_path_factory) -> dict:
    """Both rollouts' three syncs of one family, on one spawned rank."""
    path = make_tiny_hf_model(str(tmp_path_factory.mktemp(family)), **FAMILIES[family])
    return run_on_ranks(_syncs, 1, ParallelSizes(), args=(path, TWICE[family]), timeout_s=400)[0]


def _step_check(max_diff: float) -> str | None:
    from verl.trainer.ppo.log_prob_parity import LogProbParityError, check_log_prob_parity

    try:
        check_log_prob_parity(max_diff, "float32", TOLERANCES, step=7)
    except LogProbParityError as err:
        return str(err)
    return None


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_a_faithful_sync_passes_both_checks(syncs, rollout):
    assert syncs[rollout]["faithful"]["refused"] is None
    assert _step_check(syncs[rollout]["faithful"]["max_diff"]) is None, syncs[rollout]["faithful"]


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_two_swapped_experts_pass_the_name_check_and_are_stopped_by_the_log_prob_check(syncs, rollout):
    assert syncs[rollout]["swapped"]["refused"] is None  # every name once, every shape right
    message = _step_check(syncs[rollout]["swapped"]["max_diff"])
    assert message is not None and message.startswith("log-prob parity on step 7:"), message
    assert "misplaced a tensor" in message and "every_step=False" in message


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_a_dropped_expert_tensor_is_named_by_the_sync_and_stopped_by_the_log_prob_check(syncs, rollout):
    refused = syncs[rollout]["dropped"]["refused"]
    assert refused is not None and DROPPED in refused, refused
    assert _step_check(syncs[rollout]["dropped"]["max_diff"]) is not None, syncs[rollout]["dropped"]


@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed (the main leg has it)")
@pytest.mark.parametrize("where", ["next", "last"])
def test_a_tensor_sent_twice_into_vllm_is_named_by_the_sync(syncs, family, where):
    """Sent again right after itself (its layer still buffering in vLLM's reload) or after every other tensor."""
    refused = syncs["vllm"][f"duplicated_{where}"]["refused"]
    assert refused is not None and f"{TWICE[family]} writes " in refused and " again " in refused, refused
