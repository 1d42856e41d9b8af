"""Bad input fails before any rank starts or any model is built, naming the problem and the fix."""

import re

import pytest

from verl.models.mcore import UnsupportedHFConfigError, validate_model_build
from verl.models.tiny import make_tiny_hf_model
from verl.utils.megatron.parallel import ParallelConfigError, ParallelSizes


def test_valid_layouts_pass(tiny_moe_path):
    for sizes, world in [(ParallelSizes(), 1), (ParallelSizes(2, 2, 2, 2), 8), (ParallelSizes(2, 4, 2, 2), 16)]:
        assert validate_model_build(tiny_moe_path, sizes, world).num_experts == 8


@pytest.mark.parametrize(
    "sizes,world,message",
    [
        (ParallelSizes(tp=3), 8, "not divisible by TP x PP x CP"),
        (ParallelSizes(tp=2, pp=2, ep=4, etp=2), 8, "not divisible by ETP x EP x PP"),
        (ParallelSizes(ep=3, etp=1), 3, "num_experts=8 is not divisible by expert_model_parallel_size=3"),
        (ParallelSizes(pp=3), 3, "num_hidden_layers=4 is not divisible by pipeline_model_parallel_size=3"),
        (ParallelSizes(tp=8), 8, "num_attention_heads=4 is not divisible by tensor_model_parallel_size=8"),
        (ParallelSizes(tp=0), 1, "tensor_model_parallel_size=0 must be >= 1"),
    ],
)
def test_bad_parallel_sizes(tiny_moe_path, sizes, world, message):
    with pytest.raises(ParallelConfigError, match=re.escape(message)) as err:
        validate_model_build(tiny_moe_path, sizes, world)
    assert "actor_rollout_ref.actor.megatron." in str(err.value) or "must be >= 1" in str(err.value)


def test_expert_parallel_on_dense_model(tiny_dense_path):
    with pytest.raises(ParallelConfigError, match="model has no experts"):
        validate_model_build(tiny_dense_path, ParallelSizes(ep=2, etp=1), 2)


def test_missing_hf_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; set actor_rollout_ref.model.path"):
        validate_model_build(str(tmp_path / "nowhere"), ParallelSizes(), 1)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        validate_model_build(str(tmp_path), ParallelSizes(), 1)


def test_norm_topk_prob_false_is_refused(tmp_path):
    path = make_tiny_hf_model(str(tmp_path / "m"), kind="moe", norm_topk_prob=False)
    with pytest.raises(UnsupportedHFConfigError, match="norm_topk_prob=False"):
        validate_model_build(path, ParallelSizes(), 1)
