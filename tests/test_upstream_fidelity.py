"""The checkpoint manager as upstream verl's callers use it: constructor, refusals, formats, both model formats."""

import inspect
import json
import os

import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.checkpoint.integrity import verify_checkpoint
from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

# Upstream verl's constructor (verl/utils/checkpoint/megatron_checkpoint_manager.py at 1dda039): name -> default.
REQUIRED = object()
UPSTREAM_SIGNATURE = {
    "config": REQUIRED, "checkpoint_config": REQUIRED, "model_config": REQUIRED, "transformer_config": REQUIRED,
    "role": REQUIRED, "model": REQUIRED, "arch": REQUIRED, "hf_config": REQUIRED, "param_dtype": REQUIRED,
    "share_embeddings_and_output_weights": REQUIRED, "processing_class": REQUIRED, "optimizer": REQUIRED,
    "optimizer_scheduler": REQUIRED, "use_distributed_optimizer": REQUIRED, "use_checkpoint_opt_param_scheduler": False,
    "use_dist_checkpointing": False, "use_megatron_fsdp": False, "bridge": None, "provider": None, "peft_cls": None,
}  # fmt: skip


def test_constructor_has_upstreams_arguments_order_and_defaults():
    params = list(inspect.signature(MegatronCheckpointManager.__init__).parameters.values())[1:]
    assert [p.name for p in params] == list(UPSTREAM_SIGNATURE)
    for p in params:
        expected = UPSTREAM_SIGNATURE[p.name]
        assert (p.default is inspect.Parameter.empty) if expected is REQUIRED else (p.default == expected), p.name


def test_find_latest_ckpt_path_behaves_as_upstreams(tmp_path):
    """Upstream's callers (its trainers' resume) rely on: the tracked step directory, else None; no caller here."""
    assert [p.name for p in inspect.signature(find_latest_ckpt_path).parameters.values()] == ["path", "directory_format"]
    assert inspect.signature(find_latest_ckpt_path).parameters["directory_format"].default == "global_step_{}"
    assert find_latest_ckpt_path(None) is None
    assert find_latest_ckpt_path(str(tmp_path)) is None  # no tracker
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.warns(UserWarning, match="global_step_3, which does not exist"):
        assert find_latest_ckpt_path(str(tmp_path)) is None
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "step-3").mkdir()
    assert find_latest_ckpt_path(str(tmp_path)) == str(tmp_path / "global_step_3")
    assert find_latest_ckpt_path(str(tmp_path), "step-{}") == str(tmp_path / "step-3")


def _arguments(**overrides) -> dict:
    args = {name: None for name in UPSTREAM_SIGNATURE}
    args.update(role="actor", model=[], use_distributed_optimizer=False, **overrides)
    return args


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="use_dist_ckpt"):
        MegatronCheckpointManager(**_arguments(use_dist_ckpt=True))


@pytest.mark.parametrize("name", ["peft_cls", "provider", "use_megatron_fsdp"])
def test_upstream_only_options_are_refused_by_name(name):
    with pytest.raises(NotImplementedError, match=f"{name}="):
        MegatronCheckpointManager(**_arguments(**{name: True}))


def _save_and_reload(src: str, root: str, use_dist_checkpointing: bool) -> dict:
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = actor_configs(
        src,
        "checkpoint.save_contents=[model,optimizer,extra]",
        override("megatron.use_dist_checkpointing", use_dist_checkpointing),
        total_training_steps=TRAINING_STEPS,
    )
    actor = MegatronEngine(*configs)
    batch = torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))
    actor.train_step([batch])
    path = os.path.join(root, "global_step_1", "actor")
    actor.save_checkpoint(path, global_step=1)
    fresh = MegatronEngine(*configs)
    fresh.load_checkpoint(path)
    saved, loaded = actor.parameters_snapshot(), fresh.parameters_snapshot()
    return {"equal": all(torch.equal(saved[k], loaded[k]) for k in saved), "path": path}


@pytest.mark.parametrize("use_dist_checkpointing", [False, True])
def test_the_model_is_saved_in_the_format_asked_and_loads_back_exactly(tiny_moe_path, tmp_path, use_dist_checkpointing):
    result = run_on_ranks(_save_and_reload, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path), use_dist_checkpointing))[0]
    assert result["equal"]
    step = result["path"]
    contents = json.load(open(os.path.join(step, "ckpt_contents.json")))
    assert contents["schema_version"] == 2 and contents["backend"]["use_dist_checkpointing"] is use_dist_checkpointing
    assert contents["contents"]["model"]["format"] == ("megatron_dist_checkpoint" if use_dist_checkpointing else "huggingface")
    assert {"optimizer", "lr_scheduler", "rng_state", "transformer_config"} <= set(contents["contents"])
    has_shards = bool(os.listdir(os.path.join(step, "model", "dist_ckpt")))
    has_hf_weights = any(f.endswith(".safetensors") for f in os.listdir(os.path.join(step, "model", "huggingface")))
    assert (has_shards, has_hf_weights) == (use_dist_checkpointing, not use_dist_checkpointing)


def _upstream_api_three_saves_and_a_load(src: str, root: str) -> dict:
    """Written as against verl 0.9.1: upstream's optimizer helpers and config classes, the manager built with
    upstream's keywords, saves straight into step directories (no commit step), upstream's retention."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model
    from verl.utils.megatron.optimizer import (
        get_megatron_optimizer,
        get_megatron_optimizer_param_scheduler,
        init_megatron_optim_config,
    )
    from verl.workers.config.checkpoint import McoreCheckpointConfig
    from verl.workers.config.optimizer import McoreOptimizerConfig

    hf_config, tokenizer = AutoConfig.from_pretrained(src), AutoTokenizer.from_pretrained(src)

    def build():
        bridge = make_bridge(hf_config, dtype=torch.float32)
        model = build_megatron_model(bridge, use_distributed_optimizer=False)
        bridge.load_weights(model, src)
        optim_config = McoreOptimizerConfig(lr=1e-2, clip_grad=1.0, total_training_steps=10, use_checkpoint_opt_param_scheduler=True)
        optimizer = get_megatron_optimizer(model=model, config=init_megatron_optim_config(optim_config, use_distributed_optimizer=False, bf16=False))
        scheduler = get_megatron_optimizer_param_scheduler(optimizer=optimizer, config=optim_config)
        manager = MegatronCheckpointManager(
            config=OmegaConf.create({"model": {"path": src}}),
            checkpoint_config=McoreCheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"], load_contents=["model", "optimizer", "extra"]),
            model_config=hf_config, transformer_config=bridge.config, role="actor", model=model,
            arch=hf_config.architectures[0], hf_config=hf_config, param_dtype=torch.float32,
            share_embeddings_and_output_weights=False, processing_class=tokenizer, optimizer=optimizer,
            optimizer_scheduler=scheduler, use_distributed_optimizer=False,
            use_checkpoint_opt_param_scheduler=optim_config.use_checkpoint_opt_param_scheduler,
            use_dist_checkpointing=False, bridge=bridge,
        )  # fmt: skip
        return model, optimizer, scheduler, manager

    from verl.models.mcore.forward import train_step

    model, optimizer, scheduler, manager = build()
    batch = torch.randint(4, 90, (2, 17), generator=torch.Generator().manual_seed(0))
    for step in (1, 2, 3):
        train_step(model, optimizer, scheduler, [batch])
        manager.save_checkpoint(os.path.join(root, f"global_step_{step}"), global_step=step, max_ckpt_to_keep=2)
    saved = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    model2, _, scheduler2, manager2 = build()
    manager2.load_checkpoint(os.path.join(root, "global_step_3"))
    return {
        "equal": all(torch.equal(saved[n], p) for n, p in model2[0].named_parameters()),
        "scheduler_steps": scheduler2.num_steps,
        "kept": sorted(d for d in os.listdir(root) if d.startswith("global_step_")),
        "previous_saved_paths": [os.path.basename(p) for p in manager.previous_saved_paths],
    }


def test_code_written_against_verl091_runs_unchanged(tiny_moe_path, tmp_path):
    result = run_on_ranks(_upstream_api_three_saves_and_a_load, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path)))[0]
    assert result["equal"] and result["scheduler_steps"] == 3
    assert result["kept"] == ["global_step_2", "global_step_3"] == result["previous_saved_paths"]
    # saved in place, as upstream saves: no manifest vouches for it, and its contents file says so (a step of ours
    # that lost its manifest and mark is refused instead: tests/test_checkpoint_lifecycle.py)
    step = os.path.join(tmp_path, "global_step_3")
    assert not os.path.exists(os.path.join(step, "manifest.json"))
    assert set(json.load(open(os.path.join(step, "ckpt_contents.json")))["integrity"]) == {"saved_in_place"}
    with pytest.warns(UserWarning, match="has no manifest.json: a checkpoint saved by upstream verl \\(or in place by its API\\)"):
        verify_checkpoint(step)
