"""The seed layout once through either bridge: PP4 EP2 TP2 ETP2 on 16 ranks, ``use_distributed_optimizer=False``,
upstream's default contents (the model kept as HF weights only). Each rank builds the model, trains a step and
saves it; the save's step transaction runs the HF verification (every tensor the config implies, each of its
shape) before it commits; then the step is checked again from disk and its HF folder loaded in transformers,
whose logits are compared with the Megatron model's. Shared by tests/test_megatron_checkpoint_manager.py
(mbridge, the main leg) and tests/checks/check_seed_layout.py (Megatron-Bridge, the Python 3.12 leg, where 16 ranks
are too slow for the suite)."""

from __future__ import annotations

import json
import os
import time

import torch

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

SEED_LAYOUT = ParallelSizes(tp=2, pp=4, ep=2, etp=2)
WORLD_SIZE = 16


def batches(seed: int) -> list[torch.Tensor]:
    """Two microbatches of two rows."""
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [data[:2], data[2:]]


def check_tokens() -> torch.Tensor:
    return torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(3))


def step_path(root: str) -> str:
    return os.path.join(root, "global_step_1", "actor")


def train_save_and_logits(src: str, root: str, vanilla_mbridge: bool) -> dict:
    """On each rank: build through the bridge ``vanilla_mbridge`` names, train one step, save it as step 1;
    the bridge's name, the step's loss, the HF tensor count the save's verification checked, and the
    model's logits of ``check_tokens()`` after the step."""
    from verl.models.mcore.bridge import bridge_name
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = actor_configs(
        src, "megatron.use_distributed_optimizer=False", override("megatron.vanilla_mbridge", vanilla_mbridge), total_training_steps=TRAINING_STEPS
    )
    actor = MegatronEngine(*configs)
    loss = actor.train_step(batches(0))["loss"]
    actor.save_checkpoint(step_path(root), global_step=1)
    return {
        "bridge": bridge_name(actor.bridge),
        "loss": loss,
        "hf_tensors_verified": actor.last_committed.hf_tensors,
        "logits": actor.logits(check_tokens()),
    }


def seed_layout_report(src: str, root: str, vanilla_mbridge: bool, timeout_s: float = 600.0) -> dict:
    """Run ``train_save_and_logits`` at the seed layout, then check the step from disk: what it holds, its
    manifest's layout, the integrity check a resume runs (the HF verification among it), and the HF folder
    loaded in transformers (missing / unexpected keys, largest logits gap to the Megatron model)."""
    from transformers import AutoModelForCausalLM

    from verl.utils.checkpoint.integrity import verify_checkpoint, verify_step_hf_export

    start = time.monotonic()
    ranks = run_on_ranks(train_save_and_logits, WORLD_SIZE, SEED_LAYOUT, args=(src, root, vanilla_mbridge), timeout_s=timeout_s)
    ranks_s = time.monotonic() - start
    step = step_path(root)
    contents = verify_checkpoint(step)  # raises, naming the file, on anything a resume would refuse
    manifest = json.loads(open(os.path.join(step, "manifest.json")).read())
    hf = os.path.join(step, "model", "huggingface")
    model, info = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    with torch.no_grad():
        reference = model(check_tokens()).logits
    return {
        "bridge": sorted({rank["bridge"] for rank in ranks}),
        "losses": sorted({rank["loss"] for rank in ranks}),
        "hf_tensors_verified_at_save": sorted({rank["hf_tensors_verified"] for rank in ranks}),
        "hf_tensors_verified_from_disk": verify_step_hf_export(step),
        "schema_version": contents["schema_version"],
        "save_contents": contents["save_contents"],
        "model_format": contents["contents"]["model"]["format"],
        "parallel": manifest["parallel"],
        "non_empty": {part: any(os.scandir(os.path.join(step, part))) for part in ("optimizer/dist_ckpt", "extra/dist_ckpt", "model/huggingface", "model/dist_ckpt")},
        "transformers_missing_keys": sorted(info["missing_keys"]),
        "transformers_unexpected_keys": sorted(info["unexpected_keys"]),
        "logits_gap_vs_transformers": (ranks[0]["logits"] - reference).abs().max().item(),
        "ranks_s": round(ranks_s, 1),
        "total_s": round(time.monotonic() - start, 1),
    }


def seed_layout_problems(report: dict, bridge: str) -> list[str]:
    """What in ``report`` falls short of the seed layout's contract (empty: every check passed)."""
    expected = {
        "bridge": [bridge],
        "schema_version": 2,
        "save_contents": ["model", "optimizer", "extra", "hf_model"],
        "model_format": "huggingface",
        "parallel": {"world_size": WORLD_SIZE, "tp": 2, "pp": 4, "ep": 2, "etp": 2, "cp": 1},
        # upstream's default keeps the model as HF only: model/dist_ckpt exists, empty
        "non_empty": {"optimizer/dist_ckpt": True, "extra/dist_ckpt": True, "model/huggingface": True, "model/dist_ckpt": False},
        "transformers_missing_keys": [],
        "transformers_unexpected_keys": [],
    }
    problems = [f"{key}: {report[key]!r}, expected {value!r}" for key, value in expected.items() if report[key] != value]
    counts = report["hf_tensors_verified_at_save"]
    if len(counts) != 1 or counts[0] != report["hf_tensors_verified_from_disk"] or counts[0] is None:
        problems.append(f"HF tensors verified: {counts} at the save, {report['hf_tensors_verified_from_disk']} from disk")
    if len(report["losses"]) != 1 or not torch.isfinite(torch.tensor(report["losses"][0])):
        problems.append(f"the step's loss differs between ranks or is not finite: {report['losses']}")
    if not report["logits_gap_vs_transformers"] <= 1e-5:
        problems.append(f"logits differ from transformers' by {report['logits_gap_vs_transformers']}")
    return problems
