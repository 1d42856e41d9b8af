"""A test-only stand-in for TransformerEngine, so megatron-core builds its TE layer spec on a CPU host.

TransformerEngine cannot be installed without a GPU, yet the usual GPU setup builds the model from
megatron-core's TE spec (mbridge's default), whose parameter names differ from the local spec's. This
module answers ``import transformer_engine`` with module classes that allocate what TE's allocate and
nothing more: the same parameter names (``weight``, ``bias``, ``layer_norm_weight``, ``layer_norm_bias``,
``weight{i}`` / ``bias{i}`` of a grouped linear), shapes per tensor-parallel rank, the tensor-parallel
attributes TE's ``reset_parameters`` sets, and an ``_extra_state`` on every module (TE's FP8 metadata).
They run no kernel: a forward raises. Parameters live in host memory whatever device megatron asks for.

Scoped to the processes a test starts: a ``TeHost`` runs ranks from an interpreter of its own whose
``PYTHONPATH`` (``te_host_env``) holds a ``transformer_engine`` package that installs this stand-in, so
megatron-core sees TE from its first import, as on a CUDA host; the test process and every other rank never
see it. Only a save and a load run there (a forward would need TE's kernels).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import types
from contextlib import nullcontext
from typing import Any

import torch

VERSION = "2.6.0"  # a TE 2.x with grouped GEMM (>= 1.9) and without the fused router (>= 2.7)

_BOOTSTRAP = "from tests import te_stand_in\n\nte_stand_in.install_as(__name__)\n"


def te_host_env(root: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``PYTHONPATH`` first naming ``root``, where a
    ``transformer_engine`` package that installs the stand-in is written; the repository stays importable."""
    package = os.path.join(root, "transformer_engine")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as handle:
        handle.write(_BOOTSTRAP)
    env = dict(os.environ if env is None else env)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, repo, env.get("PYTHONPATH", "")) if p)
    return env


_SERVER = """
import sys
from tests import te_stand_in
te_stand_in._serve()
"""


class TeHost:
    """One interpreter that imports the stand-in as ``transformer_engine`` (so does its fork server, hence every
    rank): megatron-core, mbridge and verl see TE installed, as on a CUDA host. It serves one run at a time,
    so a module's cases share its start-up (interpreter, imports, fork server) instead of paying it each.

    ``run(fn, ...)`` is ``run_on_ranks(fn, world_size, sizes, args)`` there; ``fn``: ``"module:function"``;
    arguments and results go as JSON. A run that fails raises here with its traceback; one that exceeds its
    timeout stops the interpreter (the next run starts another)."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._runs = 0
        self._process: subprocess.Popen | None = None

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            log = open(os.path.join(self._root, "te_host.log"), "a")
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVER], env=te_host_env(os.path.join(self._root, "site")),
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )
            log.close()
        return self._process

    def run(self, fn: str, world_size: int, sizes: Any, args: tuple = (), timeout_s: float = 600.0) -> list:
        self._runs += 1
        request = os.path.join(self._root, f"request_{self._runs}.json")
        with open(request, "w") as handle:
            json.dump({"fn": fn, "world_size": world_size, "sizes": dataclasses.asdict(sizes), "args": list(args)}, handle)
        process = self._started()
        process.stdin.write(request + "\n")
        process.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(request + ".out"):
            if process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the TE-host run of {fn} ended without a result:\n{self._log_tail()}")
            time.sleep(0.2)
        with open(request + ".out") as handle:
            answer = json.load(handle)
        if not answer["ok"]:
            raise RuntimeError(f"the TE-host run of {fn} failed:\n{answer['error'][-6000:]}")
        return answer["results"]

    def _log_tail(self) -> str:
        with open(os.path.join(self._root, "te_host.log"), errors="replace") as handle:
            return handle.read()[-6000:]

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=60)
        self._process = None


def _serve() -> None:
    """The TE host's loop: one request file a line on stdin; each answer written beside it, then renamed into
    place (the caller waits for the name)."""
    import traceback

    import transformer_engine

    from verl.utils.distributed import run_on_ranks
    from verl.utils.megatron.parallel import ParallelSizes

    assert transformer_engine.pytorch.Linear is Linear, "transformer_engine is not the stand-in"
    for line in sys.stdin:
        request = line.strip()
        with open(request) as handle:
            job = json.load(handle)
        try:
            module, _, name = job["fn"].partition(":")
            fn = getattr(importlib.import_module(module), name)
            answer = {"ok": True, "results": run_on_ranks(fn, job["world_size"], ParallelSizes(**job["sizes"]), args=tuple(job["args"]))}
        except Exception:  # noqa: BLE001 - the caller raises it, with the ranks' tracebacks
            answer = {"ok": False, "error": traceback.format_exc()}
        with open(request + ".tmp", "w") as handle:
            json.dump(answer, handle)
        os.replace(request + ".tmp", request + ".out")


def _host(device: Any) -> torch.device:
    """Where a parameter goes: the meta device when asked, host memory otherwise (there is no GPU)."""
    return torch.device("meta") if str(device) == "meta" else torch.device("cpu")


def _set_tp(tensor: torch.Tensor, dim: int) -> None:
    # megatron.core.tensor_parallel.layers.set_tensor_model_parallel_attributes, which TE calls.
    tensor.tensor_model_parallel = True
    tensor.partition_dim = dim
    tensor.partition_stride = 1


class _Module(torch.nn.Module):
    """TE's ``TransformerEngineBaseModule``: every module saves an ``_extra_state`` (its FP8 metadata,
    an empty tensor without FP8), and carries the FP8 flags megatron reads when it shards that state."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        pass

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the TransformerEngine stand-in builds modules; it runs no kernels")


class _LinearBase(_Module):
    def _allocate(
        self, names: list[tuple[str, str | None]], in_features: int, out_features: int, tp_size: int,
        parallel_mode: str | None, bias: bool, init_method: Any, device: Any, params_dtype: Any,
        sequence_parallel: bool,
    ) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.use_bias, self.sequence_parallel = parallel_mode, bias, sequence_parallel
        self.tp_size = tp_size
        rows = out_features // tp_size if parallel_mode == "column" else out_features
        cols = in_features // tp_size if parallel_mode == "row" else in_features
        dtype = params_dtype or torch.float32
        for weight_name, bias_name in names:
            weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=_host(device)))
            if init_method is not None and weight.device.type != "meta":
                init_method(weight)
            _set_tp(weight, 1 if parallel_mode == "row" else 0)
            self.register_parameter(weight_name, weight)
            if bias and bias_name is not None:
                value = torch.nn.Parameter(torch.zeros(rows, dtype=dtype, device=_host(device)))
                if parallel_mode == "column":
                    _set_tp(value, 0)
                elif parallel_mode == "row":
                    value.sequence_parallel = sequence_parallel
                self.register_parameter(bias_name, value)


class Linear(_LinearBase):
    def __init__(
        self, in_features: int, out_features: int, sequence_parallel: bool = False, tp_size: int = 1,
        init_method: Any = None, bias: bool = True, parallel_mode: str | None = None, device: Any = "cuda",
        params_dtype: Any = None, **_: Any,
    ) -> None:
        super().__init__()
        self._allocate([("weight", "bias")], in_features, out_features, tp_size, parallel_mode, bias, init_method,
                       device, params_dtype, sequence_parallel)


class LayerNormLinear(_LinearBase):
    def __init__(
        self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
        tp_size: int = 1, init_method: Any = None, bias: bool = True, parallel_mode: str | None = None,
        normalization: str = "LayerNorm", device: Any = "cuda", params_dtype: Any = None, **_: Any,
    ) -> None:
        super().__init__()
        self.eps, self.normalization = eps, normalization
        dtype = params_dtype or torch.float32
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, dtype=dtype, device=_host(device)))
        self.layer_norm_weight.sequence_parallel = sequence_parallel
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=dtype, device=_host(device)))
            self.layer_norm_bias.sequence_parallel = sequence_parallel
        self._allocate([("weight", "bias")], in_features, out_features, tp_size, parallel_mode, bias, init_method,
                       device, params_dtype, sequence_parallel)


class GroupedLinear(_LinearBase):
    def __init__(
        self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
        tp_size: int = 1, init_method: Any = None, bias: bool = True, parallel_mode: str | None = None,
        device: Any = "cuda", params_dtype: Any = None, **_: Any,
    ) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        names = [(f"weight{i}", f"bias{i}") for i in range(num_gemms)]
        self._allocate(names, in_features, out_features, tp_size, parallel_mode, bias, init_method, device,
                       params_dtype, sequence_parallel)


class _Norm(_Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, device: Any = "cuda",
        params_dtype: Any = None, with_bias: bool = True, **_: Any,
    ) -> None:
        super().__init__()
        dtype = params_dtype or torch.float32
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=_host(device)))
        self.weight.sequence_parallel = sequence_parallel
        if with_bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=_host(device)))
            self.bias.sequence_parallel = sequence_parallel


class LayerNorm(_Norm):
    pass


class RMSNorm(_Norm):
    def __init__(self, hidden_size: int, **kwargs: Any) -> None:
        super().__init__(hidden_size, with_bias=False, **kwargs)


class DotProductAttention(_Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


class _Unavailable:
    """A TE class megatron names (subclasses, annotations) but this stand-in does not provide."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} is not part of the TransformerEngine stand-in")


class QuantizedTensor(torch.Tensor):
    """TE 2's base of its FP8 tensors: megatron only tests ``isinstance`` against it; no tensor is one here."""


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def fp8_autocast(*args: Any, **kwargs: Any) -> nullcontext:
    return nullcontext()


class CudaRNGStatesTracker:
    """Subclassed by megatron's ``TECudaRNGStatesTracker`` at import; used only with ``use_te_rng_tracker``."""


def _unavailable(name: str) -> Any:
    """A TE function megatron imports by name but this stand-in does not provide: calling it raises."""

    def function(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is not part of the TransformerEngine stand-in")

    function.__name__ = name
    return function


def _module(name: str, attributes: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package whose other submodules do not exist: importing one is an ImportError
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def install_as(name: str) -> None:
    """Make module ``name`` (the bootstrap package ``transformer_engine``) the stand-in, with its submodules."""
    ops = _module(f"{name}.pytorch.ops", {
        op: type(op, (_Unavailable,), {}) for op in (
            "Sequential", "FusibleOperation", "BasicLinear", "Bias", "LayerNorm", "RMSNorm", "AllReduce",
            "ReduceScatter", "GELU", "GEGLU", "SiLU", "SwiGLU", "ReLU", "ReGLU",
        )
    })
    fp8 = _module(f"{name}.pytorch.fp8", {"FP8GlobalStateManager": FP8GlobalStateManager, "fp8_autocast": fp8_autocast})
    distributed = _module(
        f"{name}.pytorch.distributed",
        {
            "CudaRNGStatesTracker": CudaRNGStatesTracker,
            **{f: _unavailable(f) for f in ("checkpoint", "activation_recompute_forward", "is_fp8_activation_recompute_enabled")},
        },
    )
    tensor = _module(f"{name}.pytorch.tensor", {"QuantizedTensor": QuantizedTensor})
    pytorch = _module(f"{name}.pytorch", {
        "Linear": Linear, "LayerNormLinear": LayerNormLinear, "GroupedLinear": GroupedLinear,
        "LayerNorm": LayerNorm, "RMSNorm": RMSNorm, "DotProductAttention": DotProductAttention,
        "ops": ops, "fp8": fp8, "tensor": tensor, "distributed": distributed, "fp8_autocast": fp8_autocast,
    })
    recipe = _module(f"{name}.common.recipe", {
        cls: type(cls, (_Unavailable,), {}) for cls in (
            "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
            "Format",
        )
    })
    common = _module(f"{name}.common", {"recipe": recipe})
    package = sys.modules[name]
    package.__version__ = VERSION
    package.pytorch, package.common = pytorch, common
