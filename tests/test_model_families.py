"""Every supported family trains the model transformers runs (tests.family_check): Megatron's log-probs
equal transformers' in fp32, the HF export is complete and bit-exact, and a saved step resumes bit-exactly;
at TP2 with EP2 for the MoE families (2 ranks), Qwen3-MoE with dense layers mixed in at TP2 PP2 EP2 (4
ranks). The refused configs fail before anything is built, naming the field. Mixtral through the CLI on 8 ranks
is the run of tests/test_trainer_cli.py::test_grpo_on_a_gsm8k_format_parquet_file_with_validation."""

import re
from pathlib import Path

import pytest

from tests.family_check import FP32_LOG_PROB_TOLERANCE, run_family_check
from verl.models.support import SUPPORTED_MODEL_TYPES, hf_config_problems, moe_layer_pattern, rope_theta
from verl.models.tiny import make_tiny_hf_model, tiny_hf_config
from verl.utils.megatron.parallel import ParallelSizes, num_routed_experts

# (kind, config overrides, layout on 2 ranks). Each MoE case routes through EP 2 with TP 2 for the rest.
CASES = {
    "mixtral": ("mixtral", {}, ParallelSizes(tp=2, ep=2, etp=1)),
    "qwen2_moe-shared-norm_topk_false": ("qwen2_moe", {"norm_topk_prob": False}, ParallelSizes(tp=2, ep=2, etp=1)),
    "qwen2_moe-shared-norm_topk_true": ("qwen2_moe", {"norm_topk_prob": True}, ParallelSizes(tp=2, ep=2, etp=1)),
    "qwen3_moe-norm_topk_false": ("moe", {"norm_topk_prob": False}, ParallelSizes(tp=2, ep=2, etp=1)),
    "llama": ("llama", {}, ParallelSizes(tp=2)),
    "qwen2": ("qwen2", {}, ParallelSizes(tp=2)),
}


def test_cases_cover_every_supported_family():
    # The supported list printed and documented is what this file (with tests/test_megatron_model.py for
    # the Qwen3 pair at more layouts) proves.
    covered = {tiny_hf_config(kind).model_type for kind, _, _ in CASES.values()} | {"qwen3"}
    assert covered == set(SUPPORTED_MODEL_TYPES)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    supported_line = docs.split("## Supported\n\n", 1)[1].splitlines()[0]
    assert re.findall(r"`(\w+)`", supported_line.split("(")[0]) == list(SUPPORTED_MODEL_TYPES)


def _assert_trains_the_same_model(result, case: str) -> None:
    assert result.log_prob_gap <= FP32_LOG_PROB_TOLERANCE, f"{case}: Megatron log-probs differ from transformers' by {result.log_prob_gap:.3g}"
    assert not (result.export_missing or result.export_extra or result.export_changed), result
    assert result.step_export_complete, result
    assert result.resume_loss_gap == 0.0 and result.resume_differing == [], result


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers_exports_exactly_and_resumes(tmp_path, case):
    kind, overrides, sizes = CASES[case]
    src = make_tiny_hf_model(str(tmp_path / "src"), kind=kind, num_layers=2, **overrides)
    _assert_trains_the_same_model(run_family_check(src, str(tmp_path / "run"), 2, sizes), case)


@pytest.mark.parametrize(
    "overrides",
    [{"mlp_only_layers": [0, 2]}, {"decoder_sparse_step": 2}, {"decoder_sparse_step": 3, "mlp_only_layers": [5]}, {}],
    ids=["mlp_only_layers", "sparse_step_2", "both", "all_moe"],
)
def test_moe_layer_pattern_is_where_transformers_builds_experts(overrides):
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config("moe", num_layers=6, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    built = [int(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock") for layer in model.model.layers]
    assert moe_layer_pattern(config) == built


def test_qwen3_moe_with_dense_layers_trains_exports_and_resumes(tmp_path):
    # Dense layers 0 and 2, MoE layers 1 and 3: each pipeline stage holds one of each; the dense MLPs split
    # over TP 2 while the experts stay whole (ETP 1), so a dense weight named as an expert's cannot load.
    src = make_tiny_hf_model(str(tmp_path / "src"), kind="moe", num_layers=4, mlp_only_layers=[0, 2])
    _assert_trains_the_same_model(run_family_check(src, str(tmp_path / "run"), 4, ParallelSizes(tp=2, pp=2, ep=2, etp=1)), "qwen3_moe-dense-layers")


def test_transformers_5_rope_parameters_read_as_plain_rope_or_scaling():
    # transformers 5 keeps rope_theta and the scaling in rope_parameters (rope_type 'default': plain RoPE)
    plain = {"rope_theta": 1e6, "rope_type": "default"}
    assert hf_config_problems({"model_type": "qwen3_moe", "rope_parameters": plain, "rope_scaling": plain}) == []
    assert rope_theta({"rope_parameters": plain}) == 1e6 and rope_theta({"rope_theta": 1e4}) == 1e4
    (problem,) = hf_config_problems({"model_type": "llama", "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert "rope_scaling=" in problem and "llama3" in problem


def test_bridge_view_spells_transformers_5_rope_as_mbridge_reads_it():
    from transformers import PretrainedConfig

    from verl.models.mcore.mbridge import _bridge_view_of

    plain = {"rope_theta": 5e5, "rope_type": "default"}
    config = PretrainedConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=plain, rope_scaling=plain)
    view = _bridge_view_of(config)
    assert view.rope_theta == 5e5 and view.rope_scaling is None
    assert config.rope_scaling == plain and not hasattr(config, "rope_theta")


def test_mixtral_head_dim_stays_unset_in_the_users_config():
    from transformers import MixtralConfig

    from verl.models.mcore.mbridge import _bridge_view_of

    config = tiny_hf_config("mixtral")
    assert isinstance(config, MixtralConfig) and config.head_dim is None
    assert _bridge_view_of(config).head_dim == 16  # hidden_size 64 / 4 heads, what transformers uses
    assert config.head_dim is None


@pytest.mark.parametrize(
    "config,count",
    [({"num_experts": 8}, 8), ({"num_local_experts": 4}, 4), ({"n_routed_experts": 16}, 16), ({"hidden_size": 8}, 0)],
    ids=["qwen", "mixtral", "deepseek", "dense"],
)
def test_expert_count_from_every_family_key(config, count):
    assert num_routed_experts(config) == count


def test_mixtral_expert_parallel_passes_the_layout_check():
    ParallelSizes(tp=2, pp=2, ep=2, etp=2).validate_for_hf_config(8, tiny_hf_config("mixtral"))
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by expert_model_parallel_size=3"):
        ParallelSizes(ep=3, etp=1).validate_for_hf_config(3, tiny_hf_config("mixtral"))


@pytest.mark.parametrize(
    "model_type,config,field",
    [
        ("qwen2_moe", {"num_hidden_layers": 2, "mlp_only_layers": [0, 1]}, "leave no MoE layer"),
        ("qwen3_moe", {"num_hidden_layers": 2, "mlp_only_layers": [0, 1]}, "leave no MoE layer"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
        ("qwen2_moe", {"qkv_bias": False}, "qkv_bias=False"),
        ("mixtral", {"sliding_window": 4096, "num_hidden_layers": 2}, "sliding_window=4096"),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling="),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"]}, "use_sliding_window=True"),
        ("deepseek_v3", {"n_routed_experts": 8}, "model_type='deepseek_v3' is not supported"),
        ("gpt2", {}, "model_type='gpt2' is not supported"),
    ],
)
def test_refused_configs_name_the_model_and_field(model_type, config, field):
    problems = hf_config_problems({"model_type": model_type, **config})
    assert len(problems) == 1 and field in problems[0], problems
    assert model_type in problems[0]


def test_unknown_model_lists_only_the_supported_families():
    (problem,) = hf_config_problems({"model_type": "gpt2"})
    listed = problem.split("supported model types: ")[1]
    assert listed == str(list(SUPPORTED_MODEL_TYPES))
    assert "deepseek_v3" not in listed and "glm4_moe" not in listed


def test_every_problem_of_a_config_at_once(tmp_path):
    from verl.models.mcore import UnsupportedHFConfigError, validate_model_build

    path = make_tiny_hf_model(str(tmp_path / "m"), kind="qwen2_moe", num_layers=2, hidden_act="gelu", qkv_bias=False)
    with pytest.raises(UnsupportedHFConfigError) as err:
        validate_model_build(path, ParallelSizes(ep=3, etp=1), 3)
    text = "\n".join(err.value.problems)
    for expected in ("hidden_act='gelu'", "qkv_bias=False", "num_experts=8 is not divisible by expert_model_parallel_size=3"):
        assert expected in text, text


def test_deepseek_v3_refusal_names_each_feature_the_probe_shows_unbuildable():
    # docs/models.md (DeepSeek-V3) records each stage run against mbridge 0.15.1 and megatron-core 0.16.1
    (problem,) = hf_config_problems({"model_type": "deepseek_v3"})
    for feature in ("max_position_embeddings", "MLA attention", "n_group, topk_group", "fp32", "docs/models.md"):
        assert feature in problem, feature
