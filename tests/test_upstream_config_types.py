"""The config types upstream's tests and code build that this package does not train with (the critic, FSDP,
the profiler) and the upstream rules its own types share with them: each type loads and validates as
upstream's does. Upstream's own critic tests are skipped at the pinned commit, so the critic's rules are held
here. No torch needed."""

import dataclasses

import pytest
from omegaconf import OmegaConf

import verl.utils
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.profiler import ProfilerConfig
from verl.workers.config import (
    ActorConfig,
    CriticConfig,
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    McoreActorConfig,
    McoreCriticConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
)


@dataclasses.dataclass
class _Inner:
    size: int = 0


@dataclasses.dataclass
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    extra: dict = dataclasses.field(default_factory=dict)


def test_omega_conf_to_dataclass_builds_nested_dataclasses_and_is_reexported_from_verl_utils():
    built = verl.utils.omega_conf_to_dataclass(OmegaConf.create({"inner": {"size": 3}, "extra": {"a": 1}}), _Outer)
    assert isinstance(built.inner, _Inner) and built.inner.size == 3 and built.extra == {"a": 1}


def test_a_nested_target_naming_a_subclass_builds_it_and_errors_name_the_field():
    node = {"strategy": "fsdp", "ppo_micro_batch_size_per_gpu": 2, "optim": {"_target_": "verl.workers.config.FSDPOptimizerConfig", "lr": 0.1}}
    assert type(omega_conf_to_dataclass(node, ActorConfig).optim) is FSDPOptimizerConfig
    # a target that is not a subclass of the field's type leaves the field's own class
    mcore = omega_conf_to_dataclass({"optim": {"_target_": "verl.workers.config.OptimizerConfig", "lr": 0.1}}, McoreActorConfig)
    assert type(mcore.optim) is McoreOptimizerConfig
    with pytest.raises(ValueError, match=r"McoreActorConfig\.optim\.lr must be >= 0.0"):
        omega_conf_to_dataclass({"optim": {"lr": -1}}, McoreActorConfig)


def test_actor_micro_batch_rules_and_validate():
    optim = OptimizerConfig(lr=0.1)
    with pytest.raises(ValueError, match="You have set both ActorConfig.ppo_micro_batch_size AND"):
        ActorConfig(strategy="fsdp", ppo_micro_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=optim)
    with pytest.raises(ValueError, match="Please set at least one of ActorConfig.ppo_micro_batch_size"):
        ActorConfig(strategy="fsdp", optim=optim)
    assert ActorConfig(strategy="fsdp", use_dynamic_bsz=True, optim=optim).ppo_micro_batch_size is None
    # the pre-start check builds a Megatron actor from parts of its node: no micro batch size needed there
    assert McoreActorConfig().ppo_micro_batch_size_per_gpu is None
    with pytest.raises(ValueError, match="You have set both"):
        McoreActorConfig(ppo_micro_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode: McoreActorConfig.loss_agg_mode='token-max' is not one of"):
        McoreActorConfig(loss_agg_mode="token-max")
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=6, ppo_micro_batch_size=4, optim=optim)
    config.ppo_mini_batch_size = 8  # batch sizes stay settable, as upstream's
    config.validate(n_gpus=4, train_batch_size=8)
    with pytest.raises(ValueError, match="must be >= n_gpus=8"):
        config.validate(n_gpus=8, train_batch_size=8)
    config.ppo_mini_batch_size = 6
    with pytest.raises(ValueError, match="ppo_mini_batch_size=6 must be divisible by ppo_micro_batch_size=4"):
        config.validate(n_gpus=4, train_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.strategy = "megatron"


def test_fsdp_actor_hands_its_strategy_and_sequence_parallelism_to_its_engine():
    config = FSDPActorConfig(strategy="fsdp2", ulysses_sequence_parallel_size=2, use_dynamic_bsz=True, optim=FSDPOptimizerConfig(lr=0.1))
    assert (config.fsdp_config.strategy, config.fsdp_config.ulysses_sequence_parallel_size) == ("fsdp2", 2)
    config.validate(n_gpus=8, train_batch_size=8, model_config={"use_remove_padding": True})
    with pytest.raises(ValueError, match="you must enable `use_remove_padding`"):
        config.validate(n_gpus=8, train_batch_size=8, model_config={"use_remove_padding": False})
    with pytest.raises(ValueError, match=r"FSDPActorConfig.strategy='megatron' is not one of"):
        FSDPActorConfig(strategy="megatron", use_dynamic_bsz=True)


def test_fsdp_engine_and_optimizer_refuse_bad_values():
    assert (FSDPEngineConfig().fsdp_size, FSDPEngineConfig().strategy) == (-1, "fsdp")
    with pytest.raises(ValueError, match="fsdp_size must be -1"):
        FSDPEngineConfig(fsdp_size=0)
    with pytest.raises(ValueError, match="wrap_policy must be a mapping"):
        FSDPEngineConfig(wrap_policy=["TransformerBlock"])
    with pytest.raises(ValueError, match=r"min_lr_ratio must be in \[0, 1\]"):
        FSDPOptimizerConfig(min_lr_ratio=2.0)
    with pytest.warns(DeprecationWarning, match="warmup_style"):
        assert FSDPOptimizerConfig(warmup_style="cosine").lr_scheduler_type == "cosine"


def test_megatron_engine_turns_sequence_parallelism_off_at_tp1_only():
    assert McoreEngineConfig().sequence_parallel is False
    config = McoreEngineConfig(tensor_model_parallel_size=2)
    assert config.sequence_parallel is True
    config.sequence_parallel = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tensor_model_parallel_size = 4


def test_critic_rules():
    optim = OptimizerConfig(lr=0.1)
    critic = CriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=1, optim=optim)
    assert isinstance(critic.profiler, ProfilerConfig) and critic.profiler.ranks == [] and critic.shuffle is True
    critic.ppo_mini_batch_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        critic.cliprange_value = 0.3
    with pytest.raises(ValueError, match="You have set both CriticConfig.ppo_micro_batch_size AND"):
        CriticConfig(ppo_micro_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=optim)
    with pytest.raises(ValueError, match="Please set at least one of CriticConfig.ppo_micro_batch_size"):
        CriticConfig(optim=optim)
    with pytest.raises(ValueError, match="ppo_mini_batch_size=7 must be divisible by ppo_micro_batch_size=4"):
        CriticConfig(ppo_mini_batch_size=7, ppo_micro_batch_size=4, optim=optim)
    assert CriticConfig(ppo_mini_batch_size=7, ppo_micro_batch_size=4, use_dynamic_bsz=True).use_dynamic_bsz
    with pytest.raises(ValueError, match="train_batch_size=4 is below CriticConfig.ppo_mini_batch_size=8"):
        critic.validate(n_gpus=1, train_batch_size=4)
    mcore = McoreCriticConfig(ppo_micro_batch_size_per_gpu=1, optim={"lr": 0.1}, profiler={"all_ranks": True})
    assert isinstance(mcore.optim, McoreOptimizerConfig) and mcore.profiler.all_ranks and mcore.nccl_timeout == 600
    with pytest.raises(dataclasses.FrozenInstanceError):
        mcore.nccl_timeout = 60


def test_fsdp_critic_sequence_parallelism_needs_remove_padding():
    kwargs = {"ppo_micro_batch_size_per_gpu": 2, "ulysses_sequence_parallel_size": 2, "optim": FSDPOptimizerConfig(lr=0.1)}
    assert FSDPCriticConfig(model={"use_remove_padding": True}, **kwargs).fsdp.strategy == "fsdp"
    with pytest.raises(ValueError, match="When using sequence parallelism for critic, you must enable use_remove_padding"):
        FSDPCriticConfig(model={"use_remove_padding": False}, **kwargs)
    critic = FSDPCriticConfig(ppo_micro_batch_size=2, ppo_mini_batch_size=4, optim=FSDPOptimizerConfig(lr=0.1))
    critic.forward_micro_batch_size = 16
    with pytest.raises(ValueError, match="must be >= n_gpus=4"):
        critic.validate(n_gpus=4, train_batch_size=4)


def test_profiler_union_intersect_and_validation():
    first, second = ProfilerConfig(enable=True, ranks=[0, 1]), ProfilerConfig(all_ranks=True, ranks=[1, 2])
    union, both = first.union(second), first.intersect(second)
    assert (union.enable, union.all_ranks, union.ranks) == (True, True, [0, 1, 2])
    assert (both.enable, both.all_ranks, both.ranks) == (False, False, [1])
    with pytest.raises(ValueError, match="different tools: 'nsys' and 'torch'"):
        ProfilerConfig(tool="nsys").union(ProfilerConfig(tool="torch"))
    with pytest.raises(ValueError, match="ranks must be a list of ranks"):
        ProfilerConfig(ranks=0)
    assert omega_conf_to_dataclass({"_target_": "verl.utils.profiler.ProfilerConfig", "ranks": [3]}).ranks == [3]


@pytest.mark.parametrize("modules", [["q_proj", "v_proj"], "all-linear", None])
def test_model_target_modules_merge_as_a_list_a_string_or_null(modules):
    merged = OmegaConf.merge(OmegaConf.structured(HFModelConfig), {"target_modules": modules})
    assert OmegaConf.to_object(merged).target_modules == modules


def test_model_target_modules_of_another_type_are_refused():
    with pytest.raises(TypeError, match="target_modules must be a string, a list of strings or null"):
        HFModelConfig(target_modules=[1, 2])
