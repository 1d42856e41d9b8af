"""Shared fixtures: tiny HF models made locally (no hub); the CLI runs' environment and validation file."""

import subprocess
import sys

import pytest

from tests.cli_runs import REPO, cli_env
from verl.models.tiny import make_tiny_hf_model

# tests/py312: Megatron-Bridge 0.6 and the megatron-core 0.18 it runs on declare Python 3.12; scripts/test.sh's
# Python 3.12 leg runs them (PY312_TESTS), every other leg leaves them out here.
collect_ignore = ["py312"] if sys.version_info < (3, 12) else []


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory) -> str:
    """Qwen3-MoE, 4 layers, 8 experts, norm_topk_prob=True, sharded safetensors + index, tokenizer."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_moe")), kind="moe")


@pytest.fixture(scope="session")
def tiny_dense_path(tmp_path_factory) -> str:
    """Dense Qwen3, 4 layers, sharded safetensors + index, tokenizer."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_dense")), kind="dense")


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict:
    """The environment of a CLI run (``tests.cli_runs``): the embedded default model made once per session (a
    test that damages a model makes its own cache)."""
    return cli_env(tmp_path_factory.mktemp("tiny_cache"))


@pytest.fixture(scope="session")
def val_parquet(tmp_path_factory, env) -> str:
    """The default task's prompts as a parquet file, made as a user makes one (``scripts/make_task_parquet.py``)."""
    script = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_task_parquet.py"), "--out-dir", str(tmp_path_factory.mktemp("data"))],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return script.stdout.strip().splitlines()[-1]
