"""``python -m verl.trainer.main_ppo`` on the config's default bridge, Megatron-Bridge (upstream's
``vanilla_mbridge=False``), at TP1 PP2 EP2 ETP1 on 4 CPU ranks with ``use_distributed_optimizer=False`` and the
KL loss (the reference is built through it too; the run's metrics name both bridges): GRPO trains through the
first-batch log-prob parity gate, saves every step (the model as HF weights through Megatron-Bridge's own save),
and a second run resumed from step 1 repeats step 2 bit for bit; the HF folder loads in transformers.
"""

import glob
import json

import torch
from safetensors.torch import load_file

from tests.test_trainer_cli import MEGATRON, TRACKER, _metrics, _run
from tests.test_trainer_cli import env as env  # noqa: F401 - the CLI tests' fixture

CLOCKS = ("time", "checkpoint", "checkpoint_committed", "resume")  # what may differ between runs: times, save and resume records


def _command(model_path: str, ckpt) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model_path}", "trainer.n_gpus_per_node=4",
        f"{MEGATRON}tensor_model_parallel_size=1", f"{MEGATRON}pipeline_model_parallel_size=2",
        f"{MEGATRON}expert_model_parallel_size=2", f"{MEGATRON}expert_tensor_parallel_size=1",
        f"{MEGATRON}use_distributed_optimizer=False", "trainer.total_training_steps=2", "trainer.save_freq=1",
        f"trainer.default_local_dir={ckpt}", "actor_rollout_ref.actor.use_kl_loss=True",
    ]  # fmt: skip


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("timing_s/") and k not in CLOCKS}


def _hf_weights(folder) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(glob.glob(f"{folder}/*.safetensors")):
        weights.update(load_file(file))
    return weights


def test_grpo_through_megatron_bridge_trains_saves_resumes_exactly_and_exports(tmp_path, env, tiny_moe_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    whole, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    code, out = _run(_command(tiny_moe_path, whole), tmp_path, env, bridge=None)  # the config's default bridge
    assert code == 0, out[-6000:]
    assert "HF export: all 135 tensors present with the expected shapes" in out
    first = {m["step"]: m for m in _metrics(whole)}
    assert sorted(first) == [1, 2] and (whole / TRACKER).read_text() == "2"
    # the actor and the KL term's reference, each built through the config's default bridge
    assert [first[step]["bridge"] for step in (1, 2)] == [{"actor": "Megatron-Bridge", "ref": "Megatron-Bridge"}] * 2
    assert first[1]["rollout/log_prob_diff_max"] <= 1e-4  # the parity gate's measure on the first batch: it passed
    manifest = json.loads((whole / "global_step_2/actor/manifest.json").read_text())
    assert manifest["parallel"] == {"world_size": 4, "tp": 1, "pp": 2, "ep": 2, "etp": 1, "cp": 1}
    assert manifest["use_distributed_optimizer"] is False

    code, out = _run(
        [*_command(tiny_moe_path, resumed_dir), "trainer.resume_mode=resume_path", f"trainer.resume_from_path={whole}/global_step_1"],
        tmp_path, env, bridge=None,
    )  # fmt: skip
    assert code == 0, out[-6000:]
    assert f"resumed from {whole}/global_step_1 (step 1)" in out
    again = {m["step"]: m for m in _metrics(resumed_dir)}
    assert sorted(again) == [2]
    assert {"actor/grad_norm", "actor/pg_loss", "critic/score/mean"} <= set(_comparable(first[2]))
    assert _comparable(again[2]) == _comparable(first[2])
    hf = whole / "global_step_2/actor/model/huggingface"
    expected, actual = _hf_weights(hf), _hf_weights(resumed_dir / "global_step_2/actor/model/huggingface")
    assert len(expected) == 135 and sorted(actual) == sorted(expected)
    assert [name for name in expected if not torch.equal(expected[name], actual[name])] == []

    model, info = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == [], info
    assert info["unexpected_keys"] == set() or info["unexpected_keys"] == [], info
    state = model.state_dict()
    assert [name for name in expected if name in state and not torch.equal(state[name], expected[name])] == []
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()
