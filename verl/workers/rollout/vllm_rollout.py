"""Rollout on a vLLM engine in the rank's own process, weights synced in memory from the Megatron actor.

The engine starts from the HF config with dummy weights (upstream's ``load_format=dummy``); before each rollout
the actor's whole HF tensors (``gather_hf_weights``) go into the running engine through vLLM's in-place reload
(``Worker.reload_weights``), and the prefix cache is dropped. vLLM's reload is lenient by design: a layer whose
tensors do not all arrive keeps its old values or is processed half-filled, and a tensor sent twice is dropped
once the layer is complete, without an error. So the sync is verified from the engine's side: every weight
loader call the engine's model makes is recorded (parameter, shard, expert) with the HF tensor that fed it,
and a parameter slot written twice, left unwritten or written with a tensor of the wrong size fails the step
naming the tensor.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from verl.workers.config.rollout import RolloutConfig
from verl.workers.rollout.hf_rollout import RolloutSettings, response_mask
from verl.workers.rollout.vllm_log_probs import convention_problem, logprobs_mode

# Arguments of a vLLM weight loader that say where in the parameter a tensor goes (a fused parameter's shard, a
# fused MoE parameter's expert); the rest are the parameter, the tensor and flags.
_NOT_SLOT_ARGUMENTS = ("param", "loaded_weight", "weight_name", "return_success")


class WeightSyncError(RuntimeError):
    """The engine's model did not receive every parameter slot exactly once from the actor's tensors."""


def join_engine_groups() -> None:
    """Make vLLM's process groups on this rank; every rank of the torch.distributed world calls it, once, at the
    same point, before any engine starts.

    vLLM builds its groups over the whole world (``torch.distributed.new_group`` is collective over every rank),
    and an engine started on some ranks only waits for the others forever; with the groups made on every rank
    first, an engine starts on the ranks that generate and finds them made (docs/grpo.md, "The vLLM rollout").
    """
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(dist.get_world_size(), dist.get_rank(), "env://", dist.get_rank(), dist.get_backend())
        initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


class InMemoryVLLMRollout:
    """A vLLM ``LLM`` in this process, inside the trainer's torch.distributed world (``join_engine_groups`` first,
    on every rank), whose weights the actor writes in memory. The interface of ``InMemoryHFRollout``
    (``settings``, ``load_weights``, ``generate_sequences``).

    Not upstream's vLLM rollouts (a server per replica, ``generate_sequences(DataProto)``): named apart so an
    upstream caller fails on the import instead of getting a different API under the same name.
    """

    def __init__(
        self, model_path: str, hf_config: Any, settings: RolloutSettings, engine: RolloutConfig, eos_token_id: int,
        pad_token_id: int, dtype: torch.dtype = torch.float32, seed: int = 0,
    ) -> None:
        """``model_path``: the HF model directory (its config; weights too with ``load_format=auto``), ``hf_config``
        its config as the actor loaded it; ``engine``: the rollout config whose engine keys (upstream's) the engine
        takes; ``dtype``: the engine's (the trainer passes the actor's, as for the hf rollout)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: weights shared in memory
        from vllm import LLM

        self.settings = settings
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.logprobs_mode = logprobs_mode(settings.temperature)
        self._slot_sources: dict[tuple, str] = {}  # each slot -> the HF tensor that last wrote it (names what a sync misses)
        max_model_len = engine.max_model_len or engine.prompt_length + engine.response_length
        # torch.set_num_threads is replaced by vLLM's CPU worker for the whole process; keep the actor's threads.
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                seed=seed,
                skip_tokenizer_init=True,  # prompts arrive as token ids and responses leave as token ids
                distributed_executor_backend="uni",  # one worker in this process; its groups: join_engine_groups
                tensor_parallel_size=1,
                max_model_len=max_model_len,
                max_num_seqs=engine.max_num_seqs,
                max_num_batched_tokens=max(engine.max_num_batched_tokens, max_model_len),
                enable_chunked_prefill=engine.enable_chunked_prefill,
                enable_prefix_caching=engine.enable_prefix_caching,
                enforce_eager=engine.enforce_eager,
                load_format=engine.load_format,
                logprobs_mode=self.logprobs_mode,
                kv_cache_memory_bytes=kv_cache_bytes(hf_config, dtype, engine.max_num_seqs, max_model_len),
                **dict(engine.engine_kwargs.get("vllm") or {}),
            )
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload the engine's weights in place from ``(hf_name, tensor)`` pairs and drop the prefix cache.

        Returns the number of parameter slots written; raises ``WeightSyncError`` naming the tensor when a slot
        is written twice or not at all, or a tensor lands in no slot.
        """
        report = self.llm.collective_rpc(functools.partial(_reload_accounted, weights=weights, known=self._slot_sources))[0]
        self._slot_sources.update(report["sources"])
        self.llm.reset_prefix_cache()
        if report["problems"]:
            shown = "; ".join(report["problems"][:5])
            more = len(report["problems"]) - 5
            raise WeightSyncError(f"the weight sync into the vLLM engine is wrong: {shown}" + (f" (and {more} more)" if more > 0 else ""))
        return report["slots"]

    def generate_sequences(self, input_ids: torch.Tensor, seed: int, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Sample one response per row of ``input_ids`` (``[rows, prompt_len]``, left-padded where
        ``attention_mask`` is 0; None: no padding), each row with its own seed drawn from ``seed``.

        Returns what ``InMemoryHFRollout.generate_sequences`` returns: ``responses``, ``response_mask`` and
        ``rollout_log_probs`` (of the sampled tokens under ``softmax(logits / temperature)`` before top-p).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = self.settings
        problem = convention_problem(self.logprobs_mode, s.do_sample, s.temperature, s.top_p)
        if problem:
            raise ValueError(f"the vLLM rollout cannot return the actor's log-probs: {problem}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        prompts = [TokensPrompt(prompt_token_ids=row[keep.bool()].tolist()) for row, keep in zip(input_ids, mask, strict=True)]
        row_seeds = torch.randint(0, 2**62, (len(prompts),), generator=torch.Generator().manual_seed(seed)).tolist()
        params = [
            SamplingParams(
                n=1,
                temperature=s.temperature if s.do_sample else 0.0,
                top_p=s.top_p if s.do_sample else 1.0,
                max_tokens=s.response_length,
                stop_token_ids=[self.eos_token_id],
                logprobs=0,  # the sampled token's own
                seed=row_seed,
                detokenize=False,
            )
            for row_seed in row_seeds
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses = torch.full((len(prompts), s.response_length), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((len(prompts), s.response_length), dtype=torch.float32)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            log_probs[row, : len(tokens)] = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)])
        done = response_mask(responses, self.eos_token_id)
        lengths = torch.tensor([len(output.outputs[0].token_ids) for output in outputs])
        done = done * (torch.arange(s.response_length) < lengths[:, None])
        responses = responses.masked_fill(done == 0, self.pad_token_id)
        return {"responses": responses, "response_mask": done, "rollout_log_probs": log_probs * done}


def kv_cache_bytes(hf_config: Any, dtype: torch.dtype, max_num_seqs: int, max_model_len: int) -> int:
    """KV cache for ``max_num_seqs`` sequences of ``max_model_len`` tokens (plus one 128-token block each): what a
    step's rows need, instead of vLLM's CPU default of ``gpu_memory_utilization`` of the host's memory per engine."""
    text = getattr(hf_config, "text_config", hf_config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max_num_seqs * (max_model_len + 128) * per_token


def _reload_accounted(worker: Any, weights: Iterable[tuple[str, torch.Tensor]], known: dict[tuple, str]) -> dict[str, Any]:
    """Run vLLM's in-place reload on ``worker`` with every weight loader call of the model recorded; ``known``:
    the HF tensor that wrote each slot in the syncs before (a slot this one leaves unwritten is named by it).

    vLLM's reload (``Worker.reload_weights``) puts each layer back in checkpoint layout on the meta device with
    buffering loaders, then calls the model's ``load_weights``, which consumes ``weights``; once a layer has all
    its elements it is processed and its running (kernel) tensors come back. Recorders go on the running
    parameters before the reload (a tensor arriving after its layer is complete reaches those) and on the
    checkpoint-layout ones when the model asks for the first tensor (after that preparation, before any load).
    A recorder on a buffering loader keeps it as ``__wrapped__`` under its name, so vLLM unwraps it as its own.
    A tensor vLLM never moves to the meta device (a linear layer's ``bias``) keeps its running recorder, which
    sees both the buffered load and its replay when the layer completes: the replay is not a second write.
    """
    model = worker.model_runner.get_model()
    ledger = _Ledger()

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        ledger.expected = _install_recorders(model)
        for name, tensor in weights:
            ledger.current = name
            ledger.sent.append(name)
            yield name, tensor
        ledger.current = None

    _install_recorders(model)
    _ACTIVE.append(ledger)
    try:
        worker.reload_weights(weights_iterator=feed())
    finally:
        _ACTIVE.remove(ledger)
    _prepack_cpu_experts(model)
    sources = {slot: hf_name for slot, (hf_name, _) in ledger.writes.items()}
    return {"slots": len(ledger.writes), "problems": ledger.problems(known), "sources": sources}


def _prepack_cpu_experts(model: torch.nn.Module) -> None:
    """Put reloaded fused-MoE weights back in the CPU kernel's packed layout.

    vLLM 0.32 packs the experts for its CPU grouped GEMM once, at the first load; a reload copies the checkpoint
    layout into the packed parameters and skips the packing ("weight update"), so every expert computes with
    permuted weights and nothing fails (the class of upstream verl #7978). The packing is run again here.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


_ACTIVE: list[_Ledger] = []  # the ledger of the reload in progress in this process


def _install_recorders(model: torch.nn.Module) -> dict[str, int]:
    """Put a recorder on every parameter's weight loader (once per parameter object); return each parameter's
    elements that a full load writes."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    expected = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            expected[name] = _loadable_numel(module, param)
            loader = getattr(param, "weight_loader", default_weight_loader)
            if not getattr(loader, "records_slots", False):
                param.weight_loader = _recorder(name, loader)
    return expected


def _recorder(param_name: str, loader: Any) -> Any:
    original = loader
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    signature = inspect.signature(original)

    @functools.wraps(loader)
    def record(*args: Any, **kwargs: Any) -> Any:
        ledger = _ACTIVE[-1] if _ACTIVE else None
        if ledger is None:
            return loader(*args, **kwargs)
        arguments = _loader_arguments(signature, args, kwargs)
        tensor = arguments.get("loaded_weight")
        slot = (param_name, *(value for key, value in arguments.items() if key not in _NOT_SLOT_ARGUMENTS))
        if ledger.current is not None and slot in ledger.writes:
            if ledger.loaded.get(slot) is tensor and _replaying(sys._getframe(1)):  # vLLM replays a load it buffered
                return loader(*args, **kwargs)
            ledger.write(slot, 0)  # written twice: recorded, and not written again
            return True if arguments.get("return_success") else None
        try:
            result = loader(*args, **kwargs)
        except Exception as exc:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
            raise WeightSyncError(f"{ledger.source(slot)}: shape {shape} does not fit the engine's {_slot_text(slot)}: {exc}") from exc
        if ledger.current is not None and result is not False:  # False: a fused MoE loader declining another's tensor
            ledger.write(slot, tensor.numel() if isinstance(tensor, torch.Tensor) else 0)
            ledger.loaded[slot] = tensor
        return result

    record.records_slots = True
    return record


def _replaying(frame: Any) -> bool:
    """Whether a loader call comes from vLLM's processing of a completed layer (``_layerwise_process``), which
    replays the loads it buffered while the layer was on the meta device. A vLLM without that function replays
    nothing this way: the repeat is then a second write."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process
    except ImportError:
        return False
    while frame is not None:
        if frame.f_code is _layerwise_process.__code__:
            return True
        frame = frame.f_back
    return False


def _loader_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A loader call's arguments by name. vLLM calls every loader as ``loader(param, loaded_weight, *where)``; a
    loader whose own signature names them otherwise (a parameter's bound method) is read by position."""
    try:
        arguments = dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        arguments = {}
    if "loaded_weight" not in arguments:
        arguments = {"param": args[0], "loaded_weight": args[1], **{f"arg{i}": a for i, a in enumerate(args[2:])}, **kwargs}
    return arguments


class _Ledger:
    """Which HF tensor wrote which (parameter, shard, expert) slot of the engine's model, and how many elements."""

    def __init__(self) -> None:
        self.current: str | None = None  # the tensor the model is loading now; None outside the feed
        self.sent: list[str] = []
        self.writes: dict[tuple, tuple[str, int]] = {}  # slot -> (hf name, elements)
        self.loaded: dict[tuple, Any] = {}  # slot -> the tensor its loader was given (a replay gives the same again)
        self.duplicates: list[str] = []
        self.expected: dict[str, int] = {}  # parameter -> elements a full load writes

    def source(self, slot: tuple) -> str:
        """The tensor behind a loader call: the one being fed, or (when vLLM replays buffered loads) the slot's."""
        return self.current or self.writes.get(slot, ("a tensor of this sync",))[0]

    def write(self, slot: tuple, numel: int) -> None:
        if slot in self.writes:
            self.duplicates.append(f"{self.current} writes {_slot_text(slot)} again (first written by {self.writes[slot][0]})")
        else:
            self.writes[slot] = (str(self.current), numel)

    def problems(self, known: dict[tuple, str]) -> list[str]:
        """Every slot written twice, tensor that landed nowhere and parameter short of elements; a short parameter
        names the tensors that wrote its unwritten slots in an earlier sync (``known``), when there was one."""
        found = list(self.duplicates)
        landed = {hf_name for hf_name, _ in self.writes.values()}
        found += [f"{name} was sent and landed in no parameter of the engine's model" for name in self.sent if name not in landed]
        written: dict[str, int] = {}
        slots: dict[str, list[tuple]] = {}
        for slot, (_, numel) in self.writes.items():
            written[slot[0]] = written.get(slot[0], 0) + numel
            slots.setdefault(slot[0], []).append(slot[1:])
        for name, expected in self.expected.items():
            got = written.get(name, 0)
            if got != expected:
                unsent = sorted({hf_name for slot, hf_name in known.items() if slot[0] == name and slot not in self.writes})
                before = f"; those slots were written before by {', '.join(unsent)}, not by this sync" if unsent else ""
                found.append(f"the engine's {name} received {got} of its {expected} elements{_missing_text(name, slots.get(name, []))}{before}")
        return found


def _loadable_numel(module: torch.nn.Module, param: torch.Tensor) -> int:
    """Elements a checkpoint writes into ``param``: all, except a vocabulary padded past the model's own size."""
    org_vocab = getattr(module, "org_vocab_size", None)
    if org_vocab is not None and param.dim() == 2 and param.shape[0] >= org_vocab:
        return org_vocab * param.shape[1]
    return param.numel()


def _slot_text(slot: tuple) -> str:
    where = ", ".join(str(part) for part in slot[1:] if part is not None)
    return f"{slot[0]}" + (f" [{where}]" if where else "")


def _missing_text(name: str, seen: list[tuple]) -> str:
    """For a fused MoE parameter: the experts none of whose shards arrived (expert ids are the last slot part)."""
    experts = {part[-1] for part in seen if part and isinstance(part[-1], int)}
    if not experts:
        return ""
    shards = {part[:-1] for part in seen}
    incomplete = sorted(e for e in range(max(experts) + 1) if any((*shard, e) not in seen for shard in shards))
    return f" (experts short of a shard: {incomplete})" if incomplete else ""
