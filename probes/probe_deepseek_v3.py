"""Probe: can mbridge 0.15.1 + megatron-core 0.16.1 build and map a DeepSeek-V3-style model on CPU ranks
with the local (non-TransformerEngine) layer spec, through this project's bridge adapter?

A tiny model from transformers' DeepseekV3Config (MLA attention, a shared expert, the first layer dense,
sigmoid routing with a score-correction bias, grouped top-k) is taken through the stages a training run
needs, one rank, fp32; each stage prints OK or the error that stops it. The adapter refuses ``deepseek_v3`` (verl.models.support), so the probe builds the bridge class
directly. Results: docs/models.md ("DeepSeek-V3").

    .venv/bin/python -m probes.probe_deepseek_v3 [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback

import torch

TINY_DEEPSEEK_V3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_deepseek_v3(path: str) -> str:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**TINY_DEEPSEEK_V3), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _stage(name: str, fn) -> tuple[bool, object]:
    """Run one stage; print OK or the error that stops it (first line, and where it was raised)."""
    try:
        value = fn()
    except Exception as exc:  # the probe reports whatever stops a stage
        where = traceback.extract_tb(exc.__traceback__)[-1]
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        print(f"FAIL {name}: {type(exc).__name__}: {first_line}\n     (raised in {where.filename}:{where.lineno})")
        return False, None
    print(f"OK   {name}")
    return True, value


def _expect(condition: bool, why: str) -> None:
    if not condition:
        raise ValueError(why)


def probe(src: str) -> list[bool]:
    """One rank: each stage a training run needs; a stage that cannot start (an earlier one failed) is
    skipped. Returns each stage's outcome."""
    from transformers import AutoConfig

    from verl.models.mcore.mbridge import _bridge_class, _bridge_view_of
    from verl.models.mcore.model import build_megatron_model
    from verl.utils.internals import mbridge as mbridge_internals

    hf_config = _bridge_view_of(AutoConfig.from_pretrained(src))
    bridge_cls = _bridge_class(mbridge_internals.bridge_class("deepseek_v3"), use_local_spec=True)
    outcomes = []

    ok, _ = _stage("mbridge's DeepSeek-V3 config builds megatron-core 0.16.1's MLATransformerConfig", lambda: bridge_cls(hf_config, dtype=torch.float32))
    outcomes.append(ok)

    class RenamedField(bridge_cls):
        # megatron-core 0.16.1 calls the field original_max_position_embeddings
        def _build_base_config(self, text_config_key=None, **kwargs):
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
            return super()._build_base_config(text_config_key, **kwargs)

    ok, bridge = _stage("... with max_position_embeddings renamed to original_max_position_embeddings", lambda: RenamedField(hf_config, dtype=torch.float32))
    outcomes.append(ok)
    if not ok:
        return outcomes
    config = bridge.config
    outcomes.append(_stage(
        f"grouped routing mapped (HF n_group={hf_config.n_group}, topk_group={hf_config.topk_group})",
        lambda: _expect(
            config.moe_router_num_groups == hf_config.n_group and config.moe_router_group_topk == hf_config.topk_group,
            f"megatron's moe_router_num_groups={config.moe_router_num_groups}, moe_router_group_topk={config.moe_router_group_topk}: "
            "routing would pick the top-k over all experts instead of within the best groups",
        ),
    )[0])
    outcomes.append(_stage(
        f"dense first layers mapped (first_k_dense_replace={hf_config.first_k_dense_replace})",
        lambda: _expect(
            config.moe_layer_freq[: hf_config.first_k_dense_replace] == [0] * hf_config.first_k_dense_replace,
            f"moe_layer_freq={config.moe_layer_freq}",
        ),
    )[0])
    outcomes.append(_stage(
        "HF weights readable in fp32 (the parity check's dtype)",
        lambda: mbridge_internals.open_hf_weights(bridge, src),
    )[0])
    ok, model = _stage(
        "MLA attention built from megatron-core's local (non-TransformerEngine) layer spec",
        lambda: build_megatron_model(bridge, wrap_with_ddp=False),
    )
    outcomes.append(ok)
    if ok:
        outcomes.append(_stage(
            "every Megatron tensor named in HF terms",
            lambda: [mbridge_internals.hf_names(bridge, te) for te in mbridge_internals.local_to_global_names(bridge, model[0]).values()],
        )[0])
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the tiny model is written (default: a temporary directory)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="probe_deepseek_v3_")
    src = make_tiny_deepseek_v3(os.path.join(out, "src"))
    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    (outcomes,) = run_on_ranks(probe, 1, ParallelSizes(), args=(src,))
    print(f"{sum(outcomes)} of {len(outcomes)} stages passed; the model {'can' if all(outcomes) else 'cannot'} be built and mapped here")


if __name__ == "__main__":
    main()
