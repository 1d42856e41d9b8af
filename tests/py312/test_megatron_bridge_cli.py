"""``python -m verl.trainer.main_ppo`` on the config's default bridge, Megatron-Bridge (upstream's
``vanilla_mbridge=False``), at TP1 PP2 EP2 ETP1 on 4 CPU ranks with ``use_distributed_optimizer=False`` and the
KL loss (the reference is built through it too; the run's metrics name both bridges): GRPO trains through the
first-batch log-prob parity gate and saves every step (the model as HF weights through Megatron-Bridge's own
save, verified), and the HF folder loads in transformers. The run is stopped by SIGTERM once step 2 is committed
(step 3, its rollout, training or Megatron-Bridge's in-rank HF save, cut short: nothing of it committed); a
second run resumed from the stopped run's step 1 logs its step 2 metric for metric and saves its weights bit for
bit. Two launches (the 3.12 leg's budget; the main leg's SIGTERM test resumes the tracked step by itself, which
is the driver's logic, not the bridge's). The saved step 1 passes the driver's pre-start check under mbridge; a
copy claiming TransformerEngine's spec is refused there in one line (docs/checkpoint.md, "Checkpoints across
bridges").
"""

import glob
import json
import shutil

import torch
from safetensors.torch import load_file

from tests.cli_runs import MEGATRON, REPO, comparable, read_metrics, run_trainer, stop_after_a_save
from tests.main_leg import MBRIDGE


def _command(model_path: str, ckpt, steps: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model_path}", "trainer.n_gpus_per_node=4",
        f"{MEGATRON}tensor_model_parallel_size=1", f"{MEGATRON}pipeline_model_parallel_size=2",
        f"{MEGATRON}expert_model_parallel_size=2", f"{MEGATRON}expert_tensor_parallel_size=1",
        f"{MEGATRON}use_distributed_optimizer=False", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
        f"trainer.default_local_dir={ckpt}", "actor_rollout_ref.actor.use_kl_loss=True",
    ]  # fmt: skip


def _hf_weights(folder) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(glob.glob(f"{folder}/*.safetensors")):
        weights.update(load_file(file))
    return weights


def _pre_start_resume_problems(overrides: list[str], model_path: str) -> list[str]:
    """What the driver's pre-start check of the resume step (before Ray or any rank) refuses, one line each."""
    from hydra import compose, initialize_config_dir

    from verl.trainer.resume_step import check_resume_step
    from verl.trainer.run_config import ConfigError, build_run_config

    with initialize_config_dir(config_dir=str(REPO / "verl" / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_megatron_trainer", overrides=overrides)
    try:
        check_resume_step(build_run_config(config), model_path)
    except ConfigError as exc:
        return exc.problems
    return []


def _check_cross_bridge_resume(step_dir, tmp_path, model_path: str, command: list[str]) -> None:
    """The step (written through Megatron-Bridge, whose manifest says so) passes the pre-start check under mbridge:
    both build megatron-core's local spec here, so its dist checkpoints carry the names mbridge's model loads
    (tests/py312/test_megatron_bridge_engine.py loads them). The same step claiming TransformerEngine's spec, where
    the names are not proven to agree, is refused in one line naming the bridge it was written with."""
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={step_dir}"]
    manifest = json.loads((step_dir / "actor/manifest.json").read_text())
    assert manifest["bridge"] == {"name": "Megatron-Bridge", "layer_spec": "local"}
    assert _pre_start_resume_problems([MBRIDGE, *command, *resume], model_path) == []
    te_claimed = tmp_path / "te_claimed" / step_dir.name
    shutil.copytree(step_dir, te_claimed)
    manifest["bridge"]["layer_spec"] = "transformer_engine"  # what a TransformerEngine host would have written
    (te_claimed / "actor/manifest.json").write_text(json.dumps(manifest))
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={te_claimed}"]
    assert _pre_start_resume_problems([MBRIDGE, *command, *resume], model_path) == [
        f"{te_claimed}/actor was written through Megatron-Bridge (transformer_engine layer spec), this run builds through "
        "mbridge (local layer spec), whose dist-checkpoint names are not proven to match; set "
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=False (the bridge it was written with)"
    ]  # that loading only the HF weights reads HF's names whichever bridge wrote them: tests/test_resume_check.py


def test_grpo_through_megatron_bridge_trains_saves_stops_on_sigterm_resumes_exactly_and_exports(tmp_path, env, tiny_moe_path):
    from transformers import AutoModelForCausalLM

    stopped, resumed = tmp_path / "stopped", tmp_path / "resumed"
    # the config's default bridge; stopped once step 2 is committed, in step 3
    assert stop_after_a_save(_command(tiny_moe_path, stopped, 3), tmp_path, env, stopped, step=2, last=3, bridge=None) == 2
    assert not (stopped / "global_step_3" / "actor").exists()  # step 3 was cut short: nothing of it committed
    first = {m["step"]: m for m in read_metrics(stopped)}
    assert sorted(first) == [1, 2]
    assert first[2]["checkpoint"]["hf"] == "all 135 tensors present with the expected shapes"  # the save's verification
    # the actor and the KL term's reference, each built through the config's default bridge
    assert [first[step]["bridge"] for step in (1, 2)] == [{"actor": "Megatron-Bridge", "ref": "Megatron-Bridge"}] * 2
    assert first[1]["rollout/log_prob_diff_max"] <= 1e-4  # the parity gate's measure on the first batch: it passed
    manifest = json.loads((stopped / "global_step_2/actor/manifest.json").read_text())
    assert manifest["parallel"] == {"world_size": 4, "tp": 1, "pp": 2, "ep": 2, "etp": 1, "cp": 1}
    assert manifest["use_distributed_optimizer"] is False
    _check_cross_bridge_resume(stopped / "global_step_1", tmp_path, tiny_moe_path, _command(tiny_moe_path, stopped, 3))

    code, out = run_trainer(
        [*_command(tiny_moe_path, resumed, 2), "trainer.resume_mode=resume_path", f"trainer.resume_from_path={stopped}/global_step_1"],
        tmp_path, env, bridge=None,
    )  # fmt: skip
    assert code == 0, out[-6000:]
    assert f"resumed from {stopped}/global_step_1 (step 1)" in out
    again = {m["step"]: m for m in read_metrics(resumed)}
    assert sorted(again) == [2] and again[2]["bridge"] == first[2]["bridge"]
    assert {"actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "critic/score/mean"} <= set(comparable(first[2]))
    assert comparable(again[2]) == comparable(first[2])
    hf = stopped / "global_step_2/actor/model/huggingface"
    expected, actual = _hf_weights(hf), _hf_weights(resumed / "global_step_2/actor/model/huggingface")
    assert len(expected) == 135 and sorted(actual) == sorted(expected)
    assert [name for name in expected if not torch.equal(expected[name], actual[name])] == []

    model, info = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == [], info
    assert info["unexpected_keys"] == set() or info["unexpected_keys"] == [], info
    state = model.state_dict()
    assert [name for name in expected if name in state and not torch.equal(state[name], expected[name])] == []
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()
