"""The pure-PyTorch pieces of GRPO: data, sampler, reward, advantages, policy loss, logprobs, plot."""

import json
import math

import numpy as np
import pytest
import torch

from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    kl_penalty,
    kl_penalty_types,
    policy_loss_per_token,
)
from verl.utils.dataset.arithmetic import PromptSampler, make_arithmetic_dataset, prompt_length
from verl.utils.metric import plot_metric_curve
from verl.utils.reward_score import default_compute_score
from verl.utils.reward_score.arithmetic import compute_score
from verl.utils.torch_functional import logprobs_from_logits, masked_mean, masked_sum

# ---------------------------------------------------------------- dataset and sampler


def test_dataset_all_pairs_deterministic_equal_length():
    rows = make_arithmetic_dataset(seed=3)
    assert len(rows) == 100
    assert {r["prompt"] for r in rows} == {f"{a}+{b}=" for a in range(10) for b in range(10)}
    assert all(int(r["prompt"][0]) + int(r["prompt"][2]) == int(r["ground_truth"]) for r in rows)
    assert [r["index"] for r in rows] == list(range(100))
    assert {r["data_source"] for r in rows} == {"arithmetic"}
    assert prompt_length(rows) == 4
    assert rows == make_arithmetic_dataset(seed=3)
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in make_arithmetic_dataset(seed=4)]
    small = make_arithmetic_dataset(seed=3, size=7, max_operand=4)
    assert len(small) == 7 and all(int(r["prompt"][0]) <= 4 and int(r["prompt"][2]) <= 4 for r in small)


def test_first_operand_task():
    rows = make_arithmetic_dataset(seed=0, max_operand=2, task="first")
    assert len(rows) == 9 and all(r["ground_truth"] == r["prompt"][0] for r in rows)
    with pytest.raises(ValueError, match="set data.task"):
        make_arithmetic_dataset(seed=0, task="reverse")


def test_dataset_rejects_bad_arguments():
    with pytest.raises(ValueError, match="single digits"):
        make_arithmetic_dataset(seed=0, max_operand=10)
    with pytest.raises(ValueError, match="distinct pairs"):
        make_arithmetic_dataset(seed=0, size=26, max_operand=4)
    with pytest.raises(ValueError, match="one length"):
        prompt_length([{"prompt": "1+2="}, {"prompt": "10+2="}])


def test_sampler_deterministic_and_spans_epochs():
    rows = make_arithmetic_dataset(seed=0, size=10)
    a, b = PromptSampler(rows, batch_size=4, seed=1), PromptSampler(rows, batch_size=4, seed=1)
    batches = [a.next_batch() for _ in range(5)]
    assert batches == [b.next_batch() for _ in range(5)]
    assert all(len(batch) == 4 for batch in batches)
    flat = [r["index"] for batch in batches for r in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # each epoch a permutation
    assert flat[:10] != flat[10:20]  # reshuffled per epoch
    assert a.state_dict() == {"epoch": 1, "position": 10, "batches_served": 5, "seed": 1, "shuffle": True, "num_rows": 10}
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(rows, batch_size=0, seed=1)


def test_sampler_restore_across_epoch_boundary():
    rows = make_arithmetic_dataset(seed=0, size=10)
    reference = PromptSampler(rows, batch_size=3, seed=7)
    expected = [reference.next_batch() for _ in range(8)]
    saved = PromptSampler(rows, batch_size=3, seed=7)
    for _ in range(3):  # 9 of 10 rows served: the next batch straddles epochs 0 and 1
        saved.next_batch()
    state = json.loads(json.dumps(saved.state_dict()))  # plain ints survive JSON
    restored = PromptSampler(rows, batch_size=3, seed=7)
    restored.load_state_dict(state)
    assert [restored.next_batch() for _ in range(5)] == expected[3:]
    assert restored.state_dict() == reference.state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(rows, batch_size=3, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True, 10 rows; this sampler has seed=7, shuffle=False"):
        PromptSampler(rows, batch_size=3, seed=7, shuffle=False).load_state_dict(state)
    older = {key: value for key, value in state.items() if key != "shuffle"}  # saved before shuffle was recorded
    PromptSampler(rows, batch_size=3, seed=7, shuffle=False).load_state_dict(older)


# ---------------------------------------------------------------- reward


@pytest.mark.parametrize(
    "response, expected",
    [("7", 1.0), ("  7</s>", 1.0), ("7abc", 1.0), ("07", 1.0), ("8", 0.1), ("77", 0.1), ("x7", 0.0), ("", 0.0)],
)
def test_arithmetic_reward(response, expected):
    assert compute_score(response, "7", format_score=0.1) == expected
    assert compute_score(response, "7") == (1.0 if expected == 1.0 else 0.0)  # no format credit by default


def test_default_compute_score_dispatch():
    assert default_compute_score("arithmetic", "12", "12") == 1.0
    assert compute_score("3", "4", format_score=0.0, score=2.0) == 0.0
    with pytest.raises(NotImplementedError, match="arithmetic"):
        default_compute_score("gsm8k", "1", "1")


# ---------------------------------------------------------------- advantages


def test_grpo_advantage_hand_computed_and_mask():
    # group "a": scores 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); group "b": 2, 2 -> all zero.
    rewards = torch.zeros(5, 3)
    rewards[0, 2] = 1.0
    rewards[3, 0], rewards[4, 1] = 2.0, 2.0
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, np.array(["a", "a", "a", "b", "b"]))
    std = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask)
    assert torch.equal(adv, ret)
    adv_centred, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0, 0, 1, 1], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv_centred[:, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0]))


def test_grpo_advantage_singleton_groups():
    rewards = torch.tensor([[0.5, 0.0], [0.0, 0.25]])
    mask = torch.ones(2, 2)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [10, 11])
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [0.25, 0.25]]) / (1 + 1e-6))
    with pytest.raises(ValueError, match="group id per row"):
        compute_grpo_outcome_advantage(rewards, mask, [10])


# ---------------------------------------------------------------- policy loss


def _ratio_case(ratio: float, advantage: float, **kwargs) -> dict:
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(ratio))
    return policy_loss_per_token(old, new, torch.full((1, 1), advantage), **kwargs)


def test_policy_loss_clip_positive_and_negative_advantage():
    bounds = dict(cliprange_low=0.2, cliprange_high=0.3, clip_ratio_c=3.0)
    # A > 0: ratio above 1 + high is clipped (no gradient push further), below 1 - low is not.
    out = _ratio_case(1.5, 1.0, **bounds)
    assert out["pg_losses"].item() == pytest.approx(-1.3) and out["clipped_high"].item() == 1.0
    out = _ratio_case(0.5, 1.0, **bounds)
    assert out["pg_losses"].item() == pytest.approx(-0.5) and out["clipped_high"].item() == 0.0
    # A < 0: ratio below 1 - low is clipped, above 1 + high is not (up to the dual clip).
    out = _ratio_case(0.5, -1.0, **bounds)
    assert out["pg_losses"].item() == pytest.approx(0.8) and out["clipped_high"].item() == 1.0
    out = _ratio_case(2.0, -1.0, **bounds)
    assert out["pg_losses"].item() == pytest.approx(2.0) and out["clipped_lower"].item() == 0.0
    assert out["negative_approx_kl"].item() == pytest.approx(math.log(2.0))


def test_policy_loss_dual_clip_and_gradients():
    out = _ratio_case(5.0, -2.0, cliprange_low=0.2, cliprange_high=0.2, clip_ratio_c=3.0)
    assert out["pg_losses"].item() == pytest.approx(6.0) and out["clipped_lower"].item() == 1.0
    out = _ratio_case(5.0, 2.0, cliprange_low=0.2, cliprange_high=0.2, clip_ratio_c=3.0)
    assert out["clipped_lower"].item() == 0.0  # dual clip never applies to positive advantages
    log_prob = torch.tensor([[math.log(5.0), 0.0]], requires_grad=True)
    loss = policy_loss_per_token(torch.zeros(1, 2), log_prob, torch.tensor([[-2.0, 1.0]]), 0.2, 0.2, 3.0)
    loss["pg_losses"].sum().backward()
    assert log_prob.grad[0, 0] == 0.0 and log_prob.grad[0, 1] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _ratio_case(1.0, 1.0, cliprange_low=0.2, cliprange_high=0.2, clip_ratio_c=1.0)


def test_kl_penalty_estimators():
    """Upstream's estimators of KL(policy || reference) from the sampled tokens' log-probabilities."""
    logprob = torch.tensor([math.log(0.5), math.log(0.2), math.log(0.9)])
    ref = torch.tensor([math.log(0.25), math.log(0.4), math.log(0.9)])
    diff = logprob - ref
    for name in ("kl", "k1"):
        torch.testing.assert_close(kl_penalty(logprob, ref, name), diff)
    torch.testing.assert_close(kl_penalty(logprob, ref, "abs"), diff.abs())
    for name in ("mse", "k2"):
        torch.testing.assert_close(kl_penalty(logprob, ref, name), 0.5 * diff**2)
    ratio = torch.tensor([0.5, 2.0, 1.0])  # ref_prob / prob
    for name in ("low_var_kl", "k3"):
        out = kl_penalty(logprob, ref, name)
        torch.testing.assert_close(out, ratio - ratio.log() - 1)
        assert (out >= 0).all() and out[2] == 0.0
    # k3 is clamped as upstream: a log-ratio of 30 counts as 20, and the estimate as at most 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="kl_penalty='full' is not implemented"):
        kl_penalty(logprob, ref, "full")


def test_kl_penalty_plus_takes_k2_gradient_and_keeps_the_value():
    ref = torch.tensor([0.0, -1.0])
    for name in ("k1", "abs", "low_var_kl", "k3", "k2"):
        logprob = torch.tensor([-0.5, -0.2], requires_grad=True)
        out = kl_penalty(logprob, ref, f"{name}+")
        torch.testing.assert_close(out, kl_penalty(logprob, ref, name))
        out.sum().backward()
        torch.testing.assert_close(logprob.grad, (logprob - ref).detach())  # d/dx of (x - ref)^2 / 2
    assert set(kl_penalty_types()) == {f"{n}{p}" for n in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3") for p in ("", "+")}


def test_validation_knows_the_kl_estimators():
    from verl.workers.config import KL_LOSS_TYPES

    assert tuple(sorted(KL_LOSS_TYPES)) == tuple(sorted(kl_penalty_types()))


def test_compute_policy_loss_reductions():
    torch.manual_seed(0)
    old, new, adv = torch.randn(4, 5), torch.randn(4, 5) * 0.3, torch.randn(4, 5)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    pg_loss, clipfrac, kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    tok = policy_loss_per_token(old, new, adv, 0.2, 0.2, 3.0)
    torch.testing.assert_close(pg_loss, (tok["pg_losses"] * mask).sum() / mask.sum())
    torch.testing.assert_close(clipfrac, (tok["clipped_high"] * mask).sum() / mask.sum())
    torch.testing.assert_close(kl, ((old - new).clamp(-20, 20) * mask).sum() / mask.sum(), atol=1e-6, rtol=1e-6)
    assert 0.0 <= clipfrac_lower.item() <= 1.0
    # padding must not matter, even a NaN under the mask
    new_nan = new.clone()
    new_nan[2, 4] = float("nan")
    torch.testing.assert_close(compute_policy_loss(old, new_nan, adv, mask, cliprange=0.2)[0], pg_loss)


def test_agg_loss_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    # the fully masked row is neither summed nor counted (upstream's rule)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)  # empty row skipped
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, mask, "token-avg")


# loss and mask with a fully masked middle row; every expected value below is worked by hand
_AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
_AGG_MASK = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, (1 + 2 + 7 + 8 + 9) / 5),  # 27 / 5 valid tokens
        ("token-sum", {}, 27.0),
        ("seq-mean-token-sum", {}, (3 + 24) / 2),  # 13.5: two rows with a valid token, not three (9.0)
        ("seq-mean-token-sum-norm", {}, (3 + 24) / 2 / 3),  # divided by the response length
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 9}, (3 + 24) / 2 / 9),
        ("seq-mean-token-mean", {}, (3 / 2 + 24 / 3) / 2),  # 4.75
        # rank 0 of 2: the global denominators, times dp_size
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 10}, 27 / 10 * 2),
        ("token-sum", {"dp_size": 2}, 27 * 2),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 4}, 27 / 4 * 2),
        ("seq-mean-token-sum-norm", {"dp_size": 2, "global_batch_size": 4}, 27 / 4 * 2 / 3),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 4}, 9.5 / 4 * 2),
    ],
)
def test_agg_loss_hand_computed(mode, kwargs, expected):
    assert agg_loss(_AGG_LOSS, _AGG_MASK, mode, **kwargs).item() == pytest.approx(expected)
    poisoned = _AGG_LOSS.clone()
    poisoned[1, 1] = float("nan")  # under the mask: must not leak
    assert agg_loss(poisoned, _AGG_MASK, mode, **kwargs).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
def test_agg_loss_needs_global_denominator_beyond_one_rank(mode):
    with pytest.raises(ValueError, match="dp_size > 1"):
        agg_loss(_AGG_LOSS, _AGG_MASK, mode, dp_size=2)


@pytest.mark.parametrize(
    ("mode", "denominators"),
    [
        ("token-mean", {"batch_num_tokens": 5}),
        ("token-sum", {}),
        ("seq-mean-token-sum", {"global_batch_size": 2}),
        ("seq-mean-token-sum-norm", {"global_batch_size": 2}),
        ("seq-mean-token-mean", {"global_batch_size": 2}),
    ],
)
def test_agg_loss_rank_mean_is_global_aggregate(mode, denominators):
    """Rows 0-1 on rank 0 (one of them fully masked), row 2 on rank 1: the ranks' mean is the whole batch's."""
    ranks = [slice(0, 2), slice(2, 3)]
    per_rank = [agg_loss(_AGG_LOSS[r], _AGG_MASK[r], mode, dp_size=2, **denominators) for r in ranks]
    torch.testing.assert_close(torch.stack(per_rank).mean(), agg_loss(_AGG_LOSS, _AGG_MASK, mode))


def test_agg_loss_all_masked_and_weighted_masks():
    empty = torch.zeros_like(_AGG_MASK)
    assert agg_loss(_AGG_LOSS, empty, "token-sum").item() == 0.0
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert math.isnan(agg_loss(_AGG_LOSS, empty, mode).item())  # 0 / 0, as upstream
    weights = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 1.0]])
    # a weighted mask weighs each token and counts as its weight in token-mean
    assert agg_loss(_AGG_LOSS, weights, "token-sum").item() == pytest.approx(0.5 + 2 + 14 + 9)
    assert agg_loss(_AGG_LOSS, weights, "token-mean").item() == pytest.approx((0.5 + 2 + 14 + 9) / 4.5)


# ---------------------------------------------------------------- torch_functional


def test_logprobs_from_logits_matches_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 50, dtype=torch.bfloat16)
    labels = torch.randint(0, 50, (3, 6))
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    direct = torch.log(torch.softmax(logits.double(), dim=-1)).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.double(), direct, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        out, -torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
    )


def test_masked_mean_and_sum():
    values = torch.tensor([[1.0, 2.0], [3.0, float("inf")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert masked_sum(values, mask).item() == 6.0
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(values, mask, axis=-1), torch.tensor([1.5, 3.0]))
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0


# ---------------------------------------------------------------- plot


def test_plot_metric_curve_writes_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "critic/score/mean": 0.1 * s} for s in range(1, 13)] + [{"step": 13, "other": 1.0}]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    png = plot_metric_curve(str(metrics), str(tmp_path / "out" / "reward.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no line with the key"):
        plot_metric_curve(str(metrics), str(tmp_path / "x.png"), key="actor/pg_loss")
