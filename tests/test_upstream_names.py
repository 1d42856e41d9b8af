"""Names shared with upstream verl keep upstream's signatures, defaults and behaviour, so code written against upstream runs here."""

import json
import os

import numpy as np
import pytest
import torch

from verl.single_controller.base.decorator import Dispatch, register, registered_methods
from verl.single_controller.base.worker import Worker
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss
from verl.utils import fs
from verl.utils.megatron.optimizer import init_megatron_optim_config
from verl.utils.torch_functional import logprobs_from_logits
from verl.utils.tracking import Tracking
from verl.workers.config.checkpoint import CheckpointConfig
from verl.workers.config.optimizer import McoreOptimizerConfig


def test_base_config_absent_key_is_attribute_error():
    cfg = CheckpointConfig()
    with pytest.raises(AttributeError, match="no_such_key"):
        cfg["no_such_key"]
    assert "no_such_key" not in cfg and "save_contents" in cfg
    assert cfg.get("no_such_key", 7) == 7
    with pytest.raises(TypeError, match="field names"):
        cfg[0]


def test_register_defaults_to_all_to_all():
    class W:
        @register()
        def plain(self):
            pass

    assert registered_methods(W) == {"plain": Dispatch.ALL_TO_ALL}


def test_compute_policy_loss_needs_a_clip_range():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, -0.5, 0.1], [0.0, 0.3, -0.2]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3)
    with pytest.raises(TypeError, match="cliprange"):
        compute_policy_loss(old, new, adv, mask)
    with pytest.raises(TypeError, match="cliprange"):
        compute_policy_loss(old, new, adv, mask, cliprange_low=0.2)
    both = compute_policy_loss(old, new, adv, mask, cliprange_low=0.2, cliprange_high=0.2)
    torch.testing.assert_close(both, compute_policy_loss(old, new, adv, mask, cliprange=0.2))


def test_grpo_advantage_takes_upstream_config_and_no_grad():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0]], requires_grad=True)
    mask = torch.ones(3, 2)
    index = np.array(["a", "a", "b"])
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, config=object())
    assert not adv.requires_grad
    # group a: scores 1, 0 -> mean 0.5, std 0.7071; group b alone: mean 0, std 1
    expected = torch.tensor([0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6), 3.0])
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(adv, ret)


def test_logprobs_from_logits_accepts_inplace_backward():
    logits = torch.randn(2, 4, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    for flag in (True, False):
        torch.testing.assert_close(logprobs_from_logits(logits, labels, inplace_backward=flag), expected)


def test_tracking_log_backend_filter_and_finish_exit_code(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tracking = Tracking("p", "e", default_backend=["console", "file"], metrics_path=str(path))
    tracking.log({"a": 1.0}, step=1, backend=["console"])  # the file backend is not selected
    assert not path.exists()
    tracking.log({"a": 2.0}, step=2, backend=["file"])
    tracking.log({"a": 3.0}, step=3)
    assert [json.loads(line)["a"] for line in path.read_text().splitlines()] == [2.0, 3.0]
    tracking.finish(exit_code=1)
    tracking.finish(exit_code=1)  # a second call does nothing


def test_worker_exports_cuda_visible_devices(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    Worker()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    worker = Worker(cuda_visible_devices="2,3")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and worker.rank == 0


def test_muon_refusal_is_upstreams_value_error():
    with pytest.raises(ValueError, match="emerging_optimizers") as raised:
        init_megatron_optim_config(McoreOptimizerConfig(optimizer="muon"))
    assert isinstance(raised.value, NotImplementedError)  # this package's older contract holds too


def _fake_remote_copy(calls):
    def copy(src, dst, **kwargs):
        calls.append(src)
        os.makedirs(os.path.join(dst, "sub"))
        for name in ("a.txt", "sub/b.txt"):
            with open(os.path.join(dst, name), "w") as handle:
                handle.write(name)

    return copy


def test_copy_to_local_caches_a_remote_directory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(fs, "copy", _fake_remote_copy(calls))
    src = "hdfs://cluster/models/tiny"
    local = fs.copy_to_local(src, cache_dir=tmp_path)
    assert local == os.path.join(tmp_path, fs.md5_encode(src), "tiny") and calls == [src]
    assert sorted(os.listdir(local)) == [".directory_record.txt", "a.txt", "sub"]
    assert fs.copy_to_local(src, cache_dir=tmp_path) == local and calls == [src]  # reused
    os.remove(os.path.join(local, "sub", "b.txt"))  # a partial cache is copied again
    fs.copy_to_local(src, cache_dir=tmp_path)
    assert len(calls) == 2 and os.path.exists(os.path.join(local, "sub", "b.txt"))
    fs.copy_to_local(src, cache_dir=tmp_path, always_recopy=True)
    assert len(calls) == 3


def test_directory_record_and_local_paths(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    record = fs._record_directory_structure(tmp_path / "d")
    assert open(record).read().splitlines() == ["file:f"]
    assert fs._check_directory_structure(tmp_path / "d", record)
    (tmp_path / "d" / "g").mkdir()
    assert not fs._check_directory_structure(tmp_path / "d", record)
    assert not fs._check_directory_structure(tmp_path / "d", str(tmp_path / "missing.txt"))
    assert fs.copy_to_local(str(tmp_path / "d")) == str(tmp_path / "d")  # local: used in place
    assert fs.is_non_local("hdfs://x/y") and not fs.is_non_local(str(tmp_path))


def test_remote_paths_are_refused_without_a_backend(tmp_path):
    with pytest.raises(NotImplementedError, match="hdfs://x/y: HDFS paths are not supported"):
        fs.copy_to_local("hdfs://x/y", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="trailing '/'"):
        fs.copy_to_local("hdfs://x/y/", cache_dir=tmp_path)
    with pytest.raises(NotImplementedError, match="use_shm"):
        fs.copy_to_local(str(tmp_path), use_shm=True)
    fs.makedirs(str(tmp_path / "m"), exist_ok=True)
    assert fs.exists(str(tmp_path / "m"))
    (tmp_path / "m" / "f").write_text("x")
    fs.copy(str(tmp_path / "m"), str(tmp_path / "n"))
    assert (tmp_path / "n" / "f").read_text() == "x"


def test_run_ppo_refuses_a_task_runner_class():
    with pytest.raises(NotImplementedError, match="no TaskRunner"):
        run_ppo({}, task_runner_class=type("Runner", (), {}))
