"""Megatron-Bridge (the Python 3.12 leg only: Megatron-Bridge 0.6 declares Python 3.12).

The tiny Qwen3-MoE goes HF -> Megatron -> HF through ``AutoBridge`` on a CPU rank: every tensor comes back
bit-identical, and the Megatron model's logits equal transformers' on the same weights and tokens.
"""

import glob
import os

import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes


def _tokens() -> torch.Tensor:
    return torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(0))


def _round_trip(src: str, out: str) -> torch.Tensor:
    from verl.models.mcore.megatron_bridge import megatron_bridge_provider
    from verl.utils.internals.megatron_bridge import hf_save_without_modelopt

    bridge, provider = megatron_bridge_provider(src, dtype=torch.float32)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    for chunk in model:
        chunk.eval()
    tokens = _tokens()
    with torch.no_grad():
        logits = model[0](input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)
    with hf_save_without_modelopt():
        bridge.save_hf_pretrained(model, out)
    return logits


def _hf_state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    return state


def test_hf_megatron_hf_round_trip_is_bit_identical_and_logits_match_transformers(tiny_moe_path, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    logits = run_on_ranks(_round_trip, 1, ParallelSizes(), args=(tiny_moe_path, out))[0]
    source, exported = _hf_state(tiny_moe_path), _hf_state(out)
    assert sorted(exported) == sorted(source)
    assert [name for name in source if not torch.equal(source[name], exported[name])] == []
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(_tokens()).logits
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-5


def test_a_folder_naming_custom_code_is_refused_before_megatron_bridge_reads_it(tiny_moe_path, tmp_path):
    """The package's one rule holds for Megatron-Bridge too: an ``auto_map`` is refused in one line, and the
    module it names is never imported (it would create the marker file)."""
    import json
    import shutil

    import pytest

    from verl.models.mcore.megatron_bridge import megatron_bridge_provider
    from verl.utils.custom_code import CustomCodeError

    folder, marker = tmp_path / "model", tmp_path / "ran"
    shutil.copytree(tiny_moe_path, folder)
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CustomCodeError) as refused:
        megatron_bridge_provider(str(folder))
    assert "auto_map" in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists()


def test_a_family_not_proven_through_megatron_bridge_is_refused_in_one_line_before_start(tiny_moe_path, tmp_path):
    """Mixtral and Qwen2-MoE pass mbridge's checks, and Megatron-Bridge 0.6 cannot build them (on every rank, in
    many lines): the pre-start check and the bridge factory refuse them in one line naming the key that builds
    them through mbridge; the proven Qwen3-MoE passes both, and an mbridge save option is refused naming
    Megatron-Bridge's save."""
    import pytest
    from omegaconf import OmegaConf

    from verl.models.mcore import UnsupportedHFConfigError, load_hf_config
    from verl.models.mcore.bridge import make_model_bridge
    from verl.models.tiny import make_tiny_hf_model
    from verl.trainer.validation import check_model_build

    config = OmegaConf.load("verl/trainer/config/ppo_megatron_trainer.yaml")  # upstream's default: Megatron-Bridge
    assert config.actor_rollout_ref.actor.megatron.vanilla_mbridge is False
    fix = "set actor_rollout_ref.actor.megatron.vanilla_mbridge=True"
    for kind in ("mixtral", "qwen2_moe"):
        path = make_tiny_hf_model(str(tmp_path / kind), kind=kind)
        (problem,) = check_model_build(path, config)
        assert f"model_type={kind!r}" in problem and fix in problem and "\n" not in problem, problem
        with pytest.raises(UnsupportedHFConfigError) as refused:
            make_model_bridge(path, load_hf_config(path), vanilla_mbridge=False)
        assert refused.value.problems == [problem.removeprefix(f"actor_rollout_ref.model.path={path}: ")]
    assert check_model_build(tiny_moe_path, config) == []
    key = "actor_rollout_ref.actor.checkpoint.mbridge_config.memory_efficient"  # an mbridge save's option
    OmegaConf.update(config, key, True, force_add=True)
    assert check_model_build(tiny_moe_path, config) == [
        f"{key}: the bridge's HF save (Megatron-Bridge's save_hf_weights) takes no such argument (it takes: strict); remove {key}"
    ]
