"""Bad input fails before any rank starts or any model is built, naming the problem and the fix."""

import re

import pytest

from tests.main_leg import HF_ROLLOUT, MBRIDGE
from verl.models.mcore import validate_model_build
from verl.models.tiny import make_tiny_hf_model
from verl.utils.megatron.parallel import ParallelConfigError, ParallelSizes


def test_valid_layouts_pass(tiny_moe_path):
    for sizes, world in [(ParallelSizes(), 1), (ParallelSizes(2, 2, 2, 2), 8), (ParallelSizes(2, 4, 2, 2), 16), (ParallelSizes(pp=2, vpp=2), 4), (ParallelSizes(pp=2, vpp=1), 2)]:
        assert validate_model_build(tiny_moe_path, sizes, world).num_experts == 8


@pytest.mark.parametrize(
    "sizes,world,message",
    [
        (ParallelSizes(tp=3), 8, "not divisible by TP x PP x CP"),
        (ParallelSizes(tp=2, pp=2, ep=4, etp=2), 8, "not divisible by ETP x EP x PP"),
        (ParallelSizes(ep=3, etp=1), 3, "num_experts=8 is not divisible by expert_model_parallel_size=3"),
        (ParallelSizes(pp=3), 3, "num_hidden_layers=4 is not divisible by pipeline_model_parallel_size=3"),
        (ParallelSizes(tp=8), 8, "num_attention_heads=4 is not divisible by tensor_model_parallel_size=8"),
        (ParallelSizes(tp=0), 1, "tensor_model_parallel_size=0 must be >= 1"),
        (
            ParallelSizes(pp=2, vpp=4),
            2,
            "num_hidden_layers=4 does not split into pipeline_model_parallel_size=2 x virtual_pipeline_model_parallel_size=4 "
            "equal model chunks; set actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size so that 2 x it divides 4",
        ),
        (ParallelSizes(vpp=2), 1, "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size >= 2"),
        (ParallelSizes(pp=2, vpp=0), 2, "virtual_pipeline_model_parallel_size=0 must be >= 1 (or null)"),
    ],
)
def test_bad_parallel_sizes(tiny_moe_path, sizes, world, message):
    with pytest.raises(ParallelConfigError, match=re.escape(message)) as err:
        validate_model_build(tiny_moe_path, sizes, world)
    assert "actor_rollout_ref.actor.megatron." in str(err.value) or "must be >= 1" in str(err.value)


def test_expert_parallel_on_dense_model(tiny_dense_path):
    with pytest.raises(ParallelConfigError, match="model has no experts"):
        validate_model_build(tiny_dense_path, ParallelSizes(ep=2, etp=1), 2)


def test_missing_hf_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; set actor_rollout_ref.model.path"):
        validate_model_build(str(tmp_path / "nowhere"), ParallelSizes(), 1)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        validate_model_build(str(tmp_path), ParallelSizes(), 1)


def test_norm_topk_prob_false_is_built_not_refused(tmp_path):
    # The bridge adapter sets megatron's router to match (tests/test_model_families.py proves the logits).
    path = make_tiny_hf_model(str(tmp_path / "m"), kind="moe", norm_topk_prob=False)
    assert validate_model_build(path, ParallelSizes(), 1).norm_topk_prob is False


def test_dense_layers_pass_for_both_qwen_moe_families(tmp_path):
    # tests/test_family_flag_matrix.py trains both (Qwen2-MoE's was refused before the matrix showed it exact)
    validate_model_build(make_tiny_hf_model(str(tmp_path / "q3"), kind="moe", mlp_only_layers=[1]), ParallelSizes(), 1)
    validate_model_build(make_tiny_hf_model(str(tmp_path / "q2"), kind="qwen2_moe", mlp_only_layers=[1]), ParallelSizes(), 1)


def _trainer_config(tmp_path, model_config: dict, model_dir: str = "model"):
    import json

    from omegaconf import OmegaConf

    config = OmegaConf.load("verl/trainer/config/ppo_megatron_trainer.yaml")
    config.trainer.default_local_dir = str(tmp_path / "ckpt")
    config.merge_with_dotlist([MBRIDGE, HF_ROLLOUT])
    path = tmp_path / model_dir
    path.mkdir()
    (path / "config.json").write_text(json.dumps(model_config))
    return config, str(path)


def test_pre_start_check_reports_model_and_layout_problems_together(tmp_path):
    from verl.trainer.validation import check_config

    # The default layout has EP 2: a dense, unsupported model gets both lines in one report.
    config, path = _trainer_config(tmp_path, {"model_type": "gpt2", "num_hidden_layers": 4, "num_attention_heads": 4})
    problems = check_config(config, path)
    assert any("model_type='gpt2' is not supported" in p for p in problems), problems
    assert any("expert_model_parallel_size=2 but the model has no experts" in p for p in problems), problems


def test_pre_start_check_counts_mixtral_experts(tmp_path):
    from verl.trainer.validation import check_config

    mixtral = tiny_hf_config_dict("mixtral")
    assert "num_experts" not in mixtral and mixtral["num_local_experts"] == 8
    config, path = _trainer_config(tmp_path, mixtral)
    assert check_config(config, path) == []
    config.actor_rollout_ref.actor.megatron.expert_model_parallel_size = 4
    config.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size = 1
    assert check_config(config, path) == [], "8 experts over EP 4 x ETP 2 on 8 ranks"


def test_upstreams_default_bridge_is_refused_in_one_line_where_megatron_bridge_is_absent(tmp_path, monkeypatch):
    """The YAML default is upstream's, Megatron-Bridge (``vanilla_mbridge: false``). A host without it (the main
    legs: megatron.bridge made unfindable here, so the test holds on the Python 3.12 leg too) gets one line that
    names the key and its value that builds through mbridge, as the only problem of an otherwise valid run;
    nothing switches bridges silently."""
    import sys

    from omegaconf import OmegaConf

    from verl.trainer.validation import check_config

    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # importlib's "not installed"
    config, path = _trainer_config(tmp_path, tiny_hf_config_dict("moe"))
    config.actor_rollout_ref.actor.megatron.vanilla_mbridge = OmegaConf.load("verl/trainer/config/ppo_megatron_trainer.yaml").actor_rollout_ref.actor.megatron.vanilla_mbridge
    (problem,) = check_config(config, path)
    assert "Megatron-Bridge" in problem and "not installed" in problem and "\n" not in problem, problem
    assert "set actor_rollout_ref.actor.megatron.vanilla_mbridge=True" in problem, problem
    config.actor_rollout_ref.actor.megatron.vanilla_mbridge = True
    assert check_config(config, path) == []


def tiny_hf_config_dict(kind: str) -> dict:
    from verl.models.tiny import tiny_hf_config

    return tiny_hf_config(kind).to_dict()


def test_a_megatron_bridge_release_other_than_the_tested_one_is_refused_in_one_line(tmp_path, monkeypatch):
    """Megatron-Bridge 0.3.1 installs on Python 3.11 (upstream pins 0.5.2); only 0.6.x is proven here. A host whose
    megatron.bridge imports but is another release (a stand-in package with its dist-info) gets one line naming
    both releases and the key's mbridge value, as the only problem; the tested release passes."""
    from verl.trainer.validation import check_config

    packages = tmp_path / "site"
    (packages / "megatron" / "bridge").mkdir(parents=True)
    (packages / "megatron" / "bridge" / "__init__.py").write_text("")
    dist_info = packages / "megatron_bridge-0.3.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-bridge\nVersion: 0.3.1\n")
    monkeypatch.syspath_prepend(str(packages))
    config, path = _trainer_config(tmp_path, tiny_hf_config_dict("moe"))
    config.actor_rollout_ref.actor.megatron.vanilla_mbridge = False
    (problem,) = check_config(config, path)
    assert "megatron-bridge 0.3.1 is installed here, not the tested 0.6.x" in problem and "\n" not in problem, problem
    assert "set actor_rollout_ref.actor.megatron.vanilla_mbridge=True" in problem, problem
    dist_info.rename(packages / "megatron_bridge-0.6.2.dist-info")
    (packages / "megatron_bridge-0.6.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-bridge\nVersion: 0.6.2\n")
    assert check_config(config, path) == []


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("actor_rollout_ref.actor.use_torch_compile", "0", " must be true or false, got 0"),
        ("actor_rollout_ref.actor.kl_loss_coef", "-0.1", "=-0.1 must be >= 0: the KL loss would reward drifting from the reference"),
        ("actor_rollout_ref.rollout.val_kwargs.top_p", "-1", " must be >= 0.0, got -1"),
        ("actor_rollout_ref.rollout.calculate_log_probs", "1", " must be true or false, got 1"),
        ("actor_rollout_ref.model.trust_remote_code", "1", " must be true or false, got 1"),
        ("actor_rollout_ref.ref.megatron.seed", "1.5", " must be an integer, got 1.5"),
        ("actor_rollout_ref.ref.megatron.use_megatron_fsdp", "1", " must be true or false, got 1"),
    ],
)
def test_a_value_the_workers_typed_configs_refuse_is_one_pre_start_line(tmp_path, key, value, message):
    """The worker builds its typed configs after Ray starts; the pre-start check builds them too, so a value they
    refuse is reported there, as the one line that names the Hydra key, with nothing started."""
    from verl.trainer.validation import check_config

    config, path = _trainer_config(tmp_path, tiny_hf_config_dict("moe"))
    config.merge_with_dotlist([f"{key}={value}"])
    assert check_config(config, path) == [f"{key}{message}"]


def test_a_null_megatron_override_is_no_override_as_upstream(tmp_path):
    from omegaconf import OmegaConf

    from verl.trainer.validation import check_config
    from verl.workers.config import megatron_worker_config

    config, path = _trainer_config(tmp_path, tiny_hf_config_dict("moe"))
    config.merge_with_dotlist(["actor_rollout_ref.actor.megatron.override_ddp_config=null", "actor_rollout_ref.actor.megatron.override_transformer_config=null"])
    assert check_config(config, path) == []
    built = megatron_worker_config(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
    assert built["actor"].megatron.override_ddp_config == {} and built["actor"].megatron.override_transformer_config == {}


def test_prepare_refuses_a_typed_config_value_as_a_config_error(tmp_path):
    """``prepare`` is what the CLI runs first; a ConfigError is its one-line message and exit 2, a bare
    ValueError would be a traceback. The run's typed config that the later steps read (``build_run_config``)
    turns a refusal into a ConfigError too."""
    from verl.trainer.main_ppo import prepare
    from verl.trainer.run_config import ConfigError, build_run_config

    config, path = _trainer_config(tmp_path, tiny_hf_config_dict("moe"))
    config.merge_with_dotlist([f"actor_rollout_ref.model.path={path}", "trainer.device=cpu", "actor_rollout_ref.actor.use_torch_compile=0"])
    with pytest.raises(ConfigError) as raised:
        prepare(config)
    assert raised.value.problems == ["actor_rollout_ref.actor.use_torch_compile must be true or false, got 0"]
    with pytest.raises(ConfigError) as raised:
        build_run_config(config)
    assert raised.value.problems == ["actor_rollout_ref.actor.use_torch_compile must be true or false, got 0"]
