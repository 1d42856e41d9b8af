"""The names the HF files hold, on transformers 4.57 and 5.x alike (verl.utils.internals.transformers).

transformers 5 keeps a MoE layer's experts fused in memory and writes them one tensor per expert; the HF
export check and the rollout's in-memory weight sync must both work in the files' names on either release.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from verl.models.tiny import tiny_hf_config
from verl.utils.checkpoint.hf_verify import expected_hf_tensors
from verl.utils.internals import InternalsChangedError
from verl.utils.internals import transformers as transformers_internals
from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings


def _files(path: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_the_expected_tensors_are_the_ones_the_files_hold(tiny_moe_path):
    files = _files(tiny_moe_path)
    expected = expected_hf_tensors(tiny_hf_config("moe"))
    assert expected == {name: tuple(t.shape) for name, t in files.items()}
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in expected


def test_the_expectation_follows_a_changed_config():
    config = tiny_hf_config("moe")
    before = expected_hf_tensors(config)
    assert expected_hf_tensors(config) == before
    config.num_hidden_layers += 1
    after = expected_hf_tensors(config)
    assert set(after) > set(before) and any(name.startswith(f"model.layers.{config.num_hidden_layers - 1}.") for name in after)


def _rollout_loaded_from(path: str) -> tuple[InMemoryHFRollout, torch.nn.Module]:
    """A rollout model that took the files' tensors, and the model transformers loads from them; asserts equal weights."""
    from transformers import AutoModelForCausalLM

    rollout = InMemoryHFRollout(tiny_hf_config("moe"), RolloutSettings(response_length=4), eos_token_id=2, pad_token_id=0)
    files = _files(path)
    assert rollout.load_weights(files.items()) == len(files)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, theirs = rollout.module.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[name], theirs[name]) for name in theirs)
    return rollout, reference


def test_the_rollout_takes_the_files_tensors_and_runs_the_model_transformers_loads(tiny_moe_path):
    rollout, reference = _rollout_loaded_from(tiny_moe_path)
    tokens = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same weights; the attention kernel chosen may differ between the two builds
        torch.testing.assert_close(rollout.module(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-6)


@pytest.mark.skipif(not transformers_internals.converts_weights_on_save(), reason="transformers 4.x converts no weight names (the 4.57 leg)")
def test_the_save_conversion_gone_fails_the_export_check_naming_it(monkeypatch):
    import transformers.core_model_loading as core_model_loading
    import transformers.modeling_utils  # noqa: F401 - imported before the name goes, as in a trainer (it imports the name)

    monkeypatch.delattr(core_model_loading, "revert_weight_conversion")
    config = tiny_hf_config("moe")
    config.vocab_size += 1  # a config no other test builds: its expectation is not known yet
    with pytest.raises(InternalsChangedError, match=r"transformers\.core_model_loading\.revert_weight_conversion is missing"):
        expected_hf_tensors(config)


def _save_conversion_returning(monkeypatch, change) -> None:
    """transformers' save-time conversion, with ``change`` applied to every tensor it returns."""
    import transformers.core_model_loading as core_model_loading

    convert = core_model_loading.revert_weight_conversion

    def revert_weight_conversion(model, state_dict):
        return {name: change(tensor) for name, tensor in convert(model, state_dict).items()}

    monkeypatch.setattr(core_model_loading, "revert_weight_conversion", revert_weight_conversion)


@pytest.mark.skipif(not transformers_internals.converts_weights_on_save(), reason="transformers 4.x converts no weight names (the 4.57 leg)")
def test_the_rollout_writes_the_model_when_the_conversion_returns_copies(monkeypatch, tiny_moe_path):
    # transformers 5.19 returns each half of a fused gate_up_proj as a contiguous copy (5.10: a view); copying
    # the actor's tensors into such copies would leave the rollout sampling from its initial weights
    _save_conversion_returning(monkeypatch, torch.clone)
    _rollout_loaded_from(tiny_moe_path)


@pytest.mark.skipif(not transformers_internals.converts_weights_on_save(), reason="transformers 4.x converts no weight names (the 4.57 leg)")
def test_a_conversion_no_view_can_write_back_is_refused_naming_it(monkeypatch):
    _save_conversion_returning(monkeypatch, lambda tensor: tensor.flip(0))
    with pytest.raises(InternalsChangedError, match=r"revert_weight_conversion returns .* no strided view of one parameter"):
        InMemoryHFRollout(tiny_hf_config("moe"), RolloutSettings(response_length=4), eos_token_id=2, pad_token_id=0)
