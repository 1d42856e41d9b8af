"""bf16 parameters with fp32 master weights: the masters are saved in the optimizer's dist checkpoint
and loaded back from it, never rebuilt from the bf16 weights; a load of the weights alone rebuilds them from the
loaded weights (not from this run's initial ones); a step saved in another dtype is refused before it loads.

The master weights are observed in the saved artifact, ``optimizer/dist_ckpt``: megatron's non-distributed
optimizer keeps them as ``optimizer.state.fp32_param.<param>``, the distributed one in the ``...param`` buckets
beside the Adam moments. After a step a master weight is almost never a bf16 number (the update is finer than
bf16's rounding), so one rebuilt from bf16 weights would be told apart at once.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.main_leg import MBRIDGE, TRAINING_STEPS, actor_configs, override
from verl.utils.checkpoint.data_only import METADATA_FILENAME, DataOnlyFileSystemReader, read_dcp_metadata
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes


def master_weights(step_path: str) -> dict[str, torch.Tensor]:
    """The fp32 master weights in a step's ``optimizer/dist_ckpt``, whole tensors by checkpoint key."""
    directory = os.path.join(step_path, "optimizer", "dist_ckpt")
    metadata = read_dcp_metadata(os.path.join(directory, METADATA_FILENAME))
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata) and (".fp32_param." in key or key.endswith(".param"))
    }
    assert state, f"{directory} holds no master weights"
    dcp.load(state, storage_reader=DataOnlyFileSystemReader(directory), no_dist=True)
    return state


def as_bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor rounded to bf16 and back: what a master rebuilt from the bf16 weights holds."""
    return {key: value.bfloat16().float() for key, value in weights.items()}


def _batches(seed: int) -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [data[:2], data[2:]]


def _actor(src: str, dtype: str, use_distributed_optimizer: bool, *overrides: str):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    megatron = (f"megatron.dtype={dtype}", override("megatron.use_distributed_optimizer", use_distributed_optimizer))
    return MegatronEngine(*actor_configs(src, *megatron, *overrides, total_training_steps=TRAINING_STEPS))


def _save_load_save(src: str, root: str, use_distributed_optimizer: bool) -> dict:
    """Train 2 steps in bf16 and save; load that step into a fresh actor and save it again at once; continue both the
    first and the loaded actor one step; load the weights alone, step at lr 0 and save. An fp32 actor then tries the
    step."""
    from verl.utils.checkpoint.integrity import CheckpointError

    saved = os.path.join(root, "saved", "global_step_2", "actor")
    first = _actor(src, "bfloat16", use_distributed_optimizer)
    for step in range(2):
        first.train_step(_batches(step))
    first.save_checkpoint(saved, global_step=2)
    first.train_step(_batches(2))
    expected = first.parameters_snapshot()

    loaded = _actor(src, "bfloat16", use_distributed_optimizer)
    loaded.load_checkpoint(saved)
    loaded.save_checkpoint(os.path.join(root, "loaded", "global_step_2", "actor"), global_step=2)
    loaded.train_step(_batches(2))
    actual = loaded.parameters_snapshot()

    # lr 0: a step leaves the masters as the load made them (a distributed optimizer that never stepped cannot save)
    weights_only = _actor(src, "bfloat16", use_distributed_optimizer, "checkpoint.load_contents=[model]", "optim.lr=0.0")
    weights_only.load_checkpoint(saved)
    weights_only.train_step(_batches(2))
    weights_only.save_checkpoint(os.path.join(root, "weights_only", "global_step_2", "actor"), global_step=2)

    fp32 = _actor(src, "float32", use_distributed_optimizer)
    try:
        fp32.load_checkpoint(saved)
        refusal = None
    except CheckpointError as exc:
        refusal = str(exc)
    return {
        "real": _real_positions(first) if use_distributed_optimizer else None,
        "differing": [name for name in expected if not torch.equal(expected[name], actual[name])],
        "param_dtypes": sorted({str(p.dtype) for p in expected.values()}),
        "refusal": refusal,
    }


def _real_positions(actor) -> torch.Tensor:
    """The distributed optimizer's one bucket: True where a parameter lies, False on its padding (never written,
    so it holds whatever memory it was given), from the DDP buffer's public index map."""
    (chunk,) = actor.model
    (buffer,) = chunk.buffers
    (bucket,) = buffer.buckets
    real = torch.zeros(bucket.numel_unpadded, dtype=torch.bool)
    for start, end, _ in buffer.param_index_map.values():
        real[start - bucket.offset : end - bucket.offset] = True
    return real


def _on_params(weights: dict[str, torch.Tensor], real: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return weights if real is None else {key: value[real] for key, value in weights.items()}


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["DO=False", "DO=True"])
def test_master_weights_are_saved_and_loaded_never_rebuilt_from_bf16(tiny_moe_path, tmp_path, use_distributed_optimizer):
    report = run_on_ranks(_save_load_save, 1, ParallelSizes(), args=(tiny_moe_path, str(tmp_path), use_distributed_optimizer))[0]
    assert report["param_dtypes"] == ["torch.bfloat16"]
    real = report["real"]
    saved = _on_params(master_weights(str(tmp_path / "saved" / "global_step_2" / "actor")), real)
    assert {value.dtype for value in saved.values()} == {torch.float32}
    # before the save the masters differ from bf16(param) (param = bf16(master) after every step)
    rounded = as_bf16(saved)
    off_grid = sum(int((saved[k] != rounded[k]).sum()) for k in saved) / sum(v.numel() for v in saved.values())
    assert off_grid > 0.5, off_grid
    # loaded back exactly: the fresh actor's masters, saved again at once, are the saved ones bit for bit
    reloaded = _on_params(master_weights(str(tmp_path / "loaded" / "global_step_2" / "actor")), real)
    assert sorted(reloaded) == sorted(saved)
    assert [key for key in saved if not torch.equal(saved[key], reloaded[key])] == []
    # and training goes on from them exactly as the run that never stopped
    assert report["differing"] == []
    # the weights alone: the masters are rebuilt from the loaded bf16 weights, not left at the initial model
    weights_only = _on_params(master_weights(str(tmp_path / "weights_only" / "global_step_2" / "actor")), real)
    assert [key for key in rounded if not torch.equal(rounded[key], weights_only[key])] == []
    # a float32 run refuses the bf16 step's optimizer state, naming the key, before anything loads
    assert "optimizer state was saved with actor_rollout_ref.actor.megatron.dtype=bfloat16" in report["refusal"]
    assert "this run uses float32" in report["refusal"] and "nothing was loaded" in report["refusal"]


def _problems(model_path: str, *overrides: str) -> list[str]:
    from hydra import compose, initialize_config_dir

    from verl.trainer.validation import check_config

    config_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "verl", "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return check_config(compose(config_name="ppo_megatron_trainer", overrides=[MBRIDGE, *overrides]), model_path)


def test_megatron_dtype_is_checked_naming_the_key(tiny_moe_path):
    key = "actor_rollout_ref.actor.megatron.dtype"
    assert _problems(tiny_moe_path) == []  # float32, the default
    for accepted in ("bfloat16", "bf16", "fp32", "float32"):
        assert _problems(tiny_moe_path, f"{key}={accepted}") == [], accepted
    assert _problems(tiny_moe_path, f"{key}=float16") == [
        f"{key}=float16: float16 training needs megatron's loss scaling, which the update step here does not apply; "
        f"set {key}=bfloat16 or float32"
    ]
    assert _problems(tiny_moe_path, f"{key}=int8") == [
        f"{key}=int8 is not a dtype here; set {key}=bfloat16 (bf16 parameters, fp32 master weights) or float32"
    ]
    # a reference dtype set apart from the actor's is checked on its own (one that follows the actor's is not repeated)
    ref_key = "actor_rollout_ref.ref.megatron.dtype"
    assert _problems(tiny_moe_path, f"{key}=int8", f"{ref_key}=int8") == [
        f"{key}=int8 is not a dtype here; set {key}=bfloat16 (bf16 parameters, fp32 master weights) or float32",
        f"{ref_key}=int8 is not a dtype here; set {ref_key}=bfloat16 (bf16 parameters, fp32 master weights) or float32",
    ]
    # the reference follows the actor's dtype; with the KL loss on, another value is refused
    kl = "actor_rollout_ref.actor.use_kl_loss=True"
    assert _problems(tiny_moe_path, kl, f"{key}=bfloat16") == []
    assert _problems(tiny_moe_path, kl, f"{key}=bfloat16", "actor_rollout_ref.ref.megatron.dtype=float32") == [
        "actor_rollout_ref.ref.megatron.dtype=float32 differs from the actor's (bfloat16): the reference runs in the "
        "actor's dtype here; set it to bfloat16 (its default follows the actor)"
    ]
