"""The GRPO pieces on Megatron ranks: in-memory weight sync to the HF rollout, logprob agreement, the update."""

import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

PROMPT_LEN, RESPONSE_LEN = 4, 12


def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(4, 99, (rows, PROMPT_LEN), generator=torch.Generator().manual_seed(7))


def _build(model_path: str, temperature: float = 1.0, **actor_fields):
    """The engine and its PPO actor: the actor node's defaults but ``actor_fields``, the rollout's length and temperature."""
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl.workers.config import McoreActorConfig, RolloutConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    actor = MegatronEngine(*actor_configs(model_path, "optim.lr=1e-3", total_training_steps=TRAINING_STEPS))
    rollout = RolloutConfig(response_length=RESPONSE_LEN, temperature=temperature)
    return actor, MegatronPPOActor(McoreActorConfig(**actor_fields), rollout, actor.model, actor.optimizer, actor.scheduler)


def _rollout_on_rank0(actor, rollout, prompts: torch.Tensor, seed: int) -> dict:
    """Every rank takes part in the in-memory weight sync; rank 0 generates and shares the result."""
    from verl.models.mcore.parallel_hf_save import gather_hf_weights

    weights = gather_hf_weights(actor.bridge, actor.model, receivers=[0])
    if rollout is not None:
        rollout.load_weights(weights.items())
    holder = [rollout.generate_sequences(prompts, seed=seed) if rollout is not None else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def _logprob_agreement(model_path: str) -> dict:
    from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings

    temperature = 0.9
    actor, ppo = _build(model_path, temperature=temperature)
    rollout = None
    if torch.distributed.get_rank() == 0:
        tok = actor.tokenizer
        rollout = InMemoryHFRollout(actor.hf_config, RolloutSettings(RESPONSE_LEN, temperature=temperature, top_p=0.9), tok.eos_token_id, tok.pad_token_id)
    prompts = _prompts(8)
    report = {}
    for phase in ("initial", "after_update"):
        out = _rollout_on_rank0(actor, rollout, prompts, seed=11)
        sequences = torch.cat([prompts, out["responses"]], dim=1)
        megatron = ppo.compute_log_prob(sequences, 2)
        mask = out["response_mask"].bool()
        report[phase] = {
            "max_diff": (megatron - out["rollout_log_probs"]).abs()[mask].max().item(),
            "log_probs": megatron,
            "tokens": int(mask.sum()),
        }
        if phase == "initial":
            advantages = torch.linspace(-1.0, 1.0, 8).unsqueeze(1).expand(8, RESPONSE_LEN).contiguous()
            report["update"] = ppo.update_policy(
                {"input_ids": sequences, "response_mask": out["response_mask"], "old_log_probs": megatron, "advantages": advantages}, 2
            )
    return report if torch.distributed.get_rank() == 0 else {}


def test_rollout_logprobs_match_megatron_before_and_after_an_update(tiny_moe_path):
    """PP2 TP2 EP2 ETP2: the HF rollout gets the actor's weights in memory; its sampled tokens' logprobs
    equal Megatron's recomputation within 1e-4, also after a PPO update (so the sync carried it)."""
    report = run_on_ranks(_logprob_agreement, 8, ParallelSizes(tp=2, pp=2, ep=2, etp=2), args=(tiny_moe_path,), timeout_s=400)[0]
    assert report["initial"]["tokens"] > 0
    assert report["initial"]["max_diff"] <= 1e-4, report["initial"]["max_diff"]
    assert report["after_update"]["max_diff"] <= 1e-4, report["after_update"]["max_diff"]
    # The update changed the policy, and the rollout sampled from the changed one.
    assert not torch.allclose(report["initial"]["log_probs"], report["after_update"]["log_probs"], atol=1e-4)
    update = report["update"]
    assert update["update_ok"] and update["grad_norm"] > 0
    # Ratio 1 at the first step: no clipping, and the loss is the token mean of -advantage.
    assert update["pg_clipfrac"] == 0.0
    assert abs(update["ppo_kl"]) < 1e-6


def _one_update(model_path: str, micro_batch_size: int) -> dict:
    from megatron.core import parallel_state as mpu

    actor, ppo = _build(model_path)
    rows = 8
    generator = torch.Generator().manual_seed(3)
    sequences = torch.randint(4, 99, (rows, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    lengths = torch.randint(1, RESPONSE_LEN + 1, (rows, 1), generator=generator)
    mask = (torch.arange(RESPONSE_LEN).unsqueeze(0) < lengths).long()
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, RESPONSE_LEN).contiguous()
    old = ppo.compute_log_prob(sequences, micro_batch_size) - 0.5 * torch.randn(rows, RESPONSE_LEN, generator=generator)
    batch = {"input_ids": sequences, "response_mask": mask, "old_log_probs": old, "advantages": advantages}
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    mine = {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}
    return ppo.update_policy(mine, micro_batch_size)


def test_policy_loss_is_a_global_token_mean(tiny_dense_path):
    """The same 8 rows as one rank x 4 microbatches of 2, and as 2 data-parallel ranks x 1 microbatch of 4:
    the same loss statistics and grad norm (the token mean spans every rank and microbatch)."""
    single = run_on_ranks(_one_update, 1, ParallelSizes(), args=(tiny_dense_path, 2), timeout_s=300)[0]
    split = run_on_ranks(_one_update, 2, ParallelSizes(), args=(tiny_dense_path, 4), timeout_s=300)[0]
    assert single["tokens"] == split["tokens"] > 0
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl"):
        assert abs(single[key] - split[key]) <= 1e-5 * max(1.0, abs(single[key])), key
    assert single["pg_clipfrac"] > 0  # the perturbed old logprobs make some ratios clip
    assert abs(single["grad_norm"] - split["grad_norm"]) <= 1e-5 * single["grad_norm"]


def _reference_kl_and_entropy(model_path: str) -> dict:
    """An actor and its reference from the same HF model; two updates with the KL and entropy terms on."""
    from verl.models.mcore.forward import forward_logits
    from verl.trainer.ppo.core_algos import kl_penalty
    from verl.utils.megatron_utils import (
        is_megatron_module_offloaded,
        load_megatron_model_to_gpu,
        offload_megatron_model_to_cpu,
    )
    from verl.workers.engine.megatron.transformer_impl import MegatronReference

    temperature, rows = 0.9, 8
    actor, ppo = _build(model_path, temperature=temperature, use_kl_loss=True, kl_loss_coef=0.0, kl_loss_type="low_var_kl", entropy_coeff=1.0)
    ref = MegatronReference(model_path, vanilla_mbridge=True)
    digest = ref.params_digest()
    generator = torch.Generator().manual_seed(5)
    sequences = torch.randint(4, 99, (rows, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    mask = torch.ones(rows, RESPONSE_LEN, dtype=torch.long)
    mask[::2, RESPONSE_LEN // 2 :] = 0
    report: dict = {}
    old, entropy = ppo.compute_log_prob_and_entropy(sequences, 2)
    probs = torch.softmax(forward_logits(actor.model, sequences)[:, :-1].double() / temperature, dim=-1)
    report["entropy_vs_full_vocab"] = (entropy.double() - (-(probs * probs.log()).sum(-1))[:, -RESPONSE_LEN:]).abs().max().item()

    offload_megatron_model_to_cpu(ref.model, offload_grad=False)
    report["offloaded"] = is_megatron_module_offloaded(ref.model)
    load_megatron_model_to_gpu(ref.model, load_grad=False)
    report["reloaded"] = not is_megatron_module_offloaded(ref.model)
    ref_log_prob = ref.compute_log_prob(sequences, RESPONSE_LEN, temperature, 2)
    report["ref_equals_initial_actor"] = torch.equal(ref_log_prob, old)

    batch = {"input_ids": sequences, "response_mask": mask, "old_log_probs": old, "advantages": torch.zeros(rows, RESPONSE_LEN), "ref_log_prob": ref_log_prob}
    report["first"] = ppo.update_policy(batch, 2)  # the entropy bonus alone (kl_loss_coef 0, advantages 0)
    report["token_mean_entropy"] = ((entropy * mask).sum() / mask.sum()).item()
    after_old, after_entropy = ppo.compute_log_prob_and_entropy(sequences, 2)
    report["entropy_after"] = ((after_entropy * mask).sum() / mask.sum()).item()
    report["kl_after_direct"] = ((kl_penalty(after_old, ref_log_prob, "low_var_kl") * mask).sum() / mask.sum()).item()
    report["second"] = ppo.update_policy({**batch, "old_log_probs": after_old}, 2)
    report["ref_unchanged"] = ref.params_digest() == digest and torch.equal(ref.compute_log_prob(sequences, RESPONSE_LEN, temperature, 4), ref_log_prob)
    return report if torch.distributed.get_rank() == 0 else {}


def test_reference_policy_kl_loss_and_entropy_bonus(tiny_dense_path):
    """TP2 on 2 ranks: the entropy computed on vocabulary shards equals the full-vocabulary entropy; the reference
    (offloaded and reloaded through the offload helpers) gives the initial actor's log-probs bit for bit and
    stays the initial model while the actor trains; the KL term is 0 before the first update and the KL to the
    reference after it; the entropy bonus alone raises the entropy."""
    report = run_on_ranks(_reference_kl_and_entropy, 2, ParallelSizes(tp=2), args=(tiny_dense_path,), timeout_s=300)[0]
    assert report["entropy_vs_full_vocab"] < 1e-5
    assert report["offloaded"] and report["reloaded"]
    assert report["ref_equals_initial_actor"]
    first, second = report["first"], report["second"]
    assert first["update_ok"] and abs(first["kl_loss"] / first["tokens"]) < 1e-7
    assert abs(first["entropy_loss"] / first["tokens"] - report["token_mean_entropy"]) < 1e-5
    assert report["entropy_after"] > report["token_mean_entropy"]  # entropy_coeff > 0 and nothing else: entropy rises
    assert second["kl_loss"] / second["tokens"] == pytest.approx(report["kl_after_direct"], rel=1e-5) and report["kl_after_direct"] > 0
    assert report["ref_unchanged"]


def _left_padded(rows: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of 2..longest tokens, left-padded with the pad id 0, and their attention mask."""
    from verl.utils.dataset.rl_dataset import left_pad, left_pad_attention_mask

    generator = torch.Generator().manual_seed(5)
    prompts = [{"input_ids": torch.randint(4, 99, (int(n),), generator=generator).tolist()} for n in torch.randint(2, longest + 1, (rows,), generator=generator)]
    return left_pad(prompts, longest, 0), left_pad_attention_mask(prompts, longest)


def _padded_parity(model_path: str) -> dict:
    from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings

    actor, ppo = _build(model_path)
    rollout = None
    if torch.distributed.get_rank() == 0:
        tok = actor.tokenizer
        rollout = InMemoryHFRollout(actor.hf_config, RolloutSettings(RESPONSE_LEN), tok.eos_token_id, tok.pad_token_id)
    prompts, prompt_mask = _left_padded(8, longest=10)
    from verl.models.mcore.parallel_hf_save import gather_hf_weights

    weights = gather_hf_weights(actor.bridge, actor.model, receivers=[0])
    if rollout is not None:
        rollout.load_weights(weights.items())
    holder = [rollout.generate_sequences(prompts, seed=3, attention_mask=prompt_mask) if rollout is not None else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    out = holder[0]
    sequences = torch.cat([prompts, out["responses"]], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(out["responses"])], dim=1)
    masked = ppo.compute_log_prob(sequences, 4, mask)
    # Four more pad columns on the left: the same log-probs when the padding is masked.
    extra = torch.zeros(sequences.shape[0], 4, dtype=sequences.dtype)
    repadded = ppo.compute_log_prob(torch.cat([extra, sequences], dim=1), 4, torch.cat([extra, mask], dim=1))
    unmasked = ppo.compute_log_prob(sequences, 4)
    response = out["response_mask"].bool()
    gap = lambda a, b: (a - b).abs()[response].max().item()  # noqa: E731
    return {
        "lengths": prompt_mask.sum(dim=1).tolist(),
        "vs_rollout": gap(masked, out["rollout_log_probs"]),
        "repadded": gap(repadded, masked),
        "unmasked_vs_rollout": gap(unmasked, out["rollout_log_probs"]),
    }


def test_left_padded_prompts_of_mixed_lengths_match_the_rollout(tiny_moe_path):
    """TP2 EP2 (2 ranks): prompts of 2..10 tokens left-padded to 10. transformers' rollout masks the padding;
    Megatron, given the same attention mask, recomputes the sampled tokens' log-probs within the fp32 parity
    tolerance, and does not change them when the padding grows. Without the mask the padding is attended to
    and the two disagree (what the mask fixes)."""
    report = run_on_ranks(_padded_parity, 2, ParallelSizes(tp=2, ep=2, etp=1), args=(tiny_moe_path,), timeout_s=400)[0]
    assert len(set(report["lengths"])) > 2, report["lengths"]
    assert report["vs_rollout"] <= 1e-5, report
    assert report["repadded"] <= 1e-5, report
    assert report["unmasked_vs_rollout"] > 1e-3, report
