"""Write an HF safetensors folder from a Megatron model with every rank writing the shards it owns;
and the same machinery in memory (``gather_hf_weights``) for the rollout's weight sync.

mbridge's ``Bridge.save_weights`` routes every tensor through every rank (a broadcast over the
pipeline group, all-gathers over EP and ETP) and then through rank 0, which writes every file. Here:

1. every rank lists what it holds: for each parameter its global (TE) name, which TP / expert-TP
   shard it is, shape and dtype; one ``all_gather_object`` gives every rank the same full picture (over a
   group kept across calls, later calls only confirm that no rank's holdings changed, and the picture and the
   file plan made of it are kept with the bridge).
   The names are mbridge's mapping of the model's own parameters, so a TE-spec model (a CUDA host with
   TransformerEngine) and a local-spec one (its names translated to the TE spec's) take the same path;
   ``_extra_state`` entries are no parameters and are never listed;
2. the shard plan (HF tensor -> file) is the source checkpoint's ``model.safetensors.index.json``
   when the model was loaded from one (the same files mbridge writes), else a plan of about one
   file per rank made from the parameters themselves;
3. each file gets one writer rank, balancing bytes per rank and preferring the rank that already
   holds most of the file's shards;
4. in rounds (one file per writer per round, so a writer holds at most one file's tensors at a
   time) the holders send the missing shards straight to the writer (point-to-point), which merges
   them and converts them to HF tensors with the bridge's own merge and conversion
   (``verl.utils.internals.mbridge``) -- so the tensors are bit-identical to mbridge's -- and writes the file;
5. rank 0 writes the index (the source index verbatim, as mbridge does, or a new one) and, only if
   it is not there yet, ``config.json``. Each rank's outcome of its writes (with the sizes it wrote), then rank 0's of the index, is
   shared (``RankComm.agree``): a rank whose write failed (a full disk) goes on sending its shards, and
   every rank raises at the end, instead of its peers waiting in a collective it never joins.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType

import torch
from mbridge.core.util import unwrap_model
from safetensors.torch import save_file

from verl.utils.checkpoint.integrity import start_writeback
from verl.utils.checkpoint.names import INDEX_FILENAME
from verl.utils.internals import mbridge as mbridge_internals
from verl.utils.rank_comm import RankComm, Transfer

MAX_FILE_BYTES = 5 * 1024**3  # transformers' default max_shard_size when there is no source plan
_NO_SOURCE_INDEX: Mapping = MappingProxyType({})  # a model not loaded from an indexed HF folder (one object: kept plans match it)


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One rank's piece of one Megatron parameter, as every rank learns it."""

    te_name: str
    index: int  # TP (or expert-TP) rank of this piece
    count: int  # how many pieces make the parameter (1: replicated)
    merge: bool  # merged across TP by the bridge (TP-split or expert weights)
    shape: tuple[int, ...]
    dtype: str
    partition_dim: int | None

    def as_data(self) -> dict:
        """The shard as JSON data (what every rank sends): ``dataclasses.asdict`` without its deep copies."""
        return {
            "te_name": self.te_name, "index": self.index, "count": self.count, "merge": self.merge,
            "shape": list(self.shape), "dtype": self.dtype, "partition_dim": self.partition_dim,
        }  # fmt: skip

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _dtype(self.dtype).itemsize


def is_expert_te_name(te_name: str) -> bool:
    """Whether a (TE-spec) parameter is a routed expert's weight: those are split over expert-tensor-parallel
    ranks (ETP), every other tensor-parallel weight over TP (which ranks hold which piece, here and in the load)."""
    return ".mlp.experts.linear_fc" in te_name


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _local_shards(bridge, models: list) -> tuple[list[_Shard], dict[tuple[str, int], torch.Tensor]]:
    """This rank's parameters (plus the router's ``expert_bias`` buffers, which mbridge also exports)."""
    mpu = bridge.mpu
    shards, tensors = [], {}
    for model in models:
        model = unwrap_model(model)
        names = mbridge_internals.local_to_global_names(bridge, model)
        params = dict(model.named_parameters())
        # the router's expert_bias is a (persistent) buffer: listed from the buffers, without building a state dict
        extra = {k: buffer for k, buffer in model.named_buffers() if "expert_bias" in k and k not in params}
        for local_name, tensor in [*params.items(), *extra.items()]:
            te_name = names[local_name]
            if is_expert_te_name(te_name):
                index, count, merge = mpu.etp_rank, mpu.etp_size, True
            elif getattr(tensor, "tensor_model_parallel", False):
                index, count, merge = mpu.tp_rank, mpu.tp_size, True
            else:
                index, count, merge = 0, 1, False
            shards.append(
                _Shard(te_name, index, count, merge, tuple(tensor.shape), str(tensor.dtype), getattr(tensor, "partition_dim", None))
            )
            tensors[(te_name, index)] = tensor  # the parameter itself: its TP attributes are needed to merge
    return shards, tensors


def _default_plan(hf_names: dict[str, list[str]], shards: dict[str, _Shard], world_size: int) -> dict[str, str]:
    """HF name -> file, in natural name order, about ``world_size`` files of similar size."""
    sizes: dict[str, int] = {}
    for te_name, names in hf_names.items():
        for name in names:
            sizes[name] = shards[te_name].nbytes * shards[te_name].count // len(names)
    ordered = sorted(sizes, key=_natural_key)
    total = sum(sizes.values())
    count = max(1, min(len(ordered), max(world_size, -(-total // MAX_FILE_BYTES))))
    target = total / count
    groups: list[list[str]] = [[]]
    filled = 0
    for name in ordered:
        if groups[-1] and filled + sizes[name] / 2 > target * len(groups) and len(groups) < count:
            groups.append([])
        groups[-1].append(name)
        filled += sizes[name]
    return {
        name: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, group in enumerate(groups) for name in group
    }


@dataclasses.dataclass
class _Picture:
    """Who holds which piece of which parameter, the same on every rank, and each parameter's HF names."""

    holders: dict[tuple[str, int], list[int]]
    meta: dict[str, _Shard]
    te_names: list[str]
    hf_names: dict[str, list[str]]
    plans: dict = dataclasses.field(default_factory=dict)  # what a caller derived from it (and its own keys), kept with it

    def pieces(self, te: str) -> list[tuple[str, int]]:
        return [(te, i) for i in range(self.meta[te].count)]


@dataclasses.dataclass
class _Holdings:
    """Every rank's picture, plus this rank's own pieces."""

    picture: _Picture
    my_tensors: dict[tuple[str, int], torch.Tensor]
    device: torch.device  # where this rank's pieces are, and so where it receives others' (CPU when it holds none)


# bridge -> (every rank's holdings as gathered, the picture made of them): while no rank's holdings change (a
# model's parameters keep their names and shapes from save to save), the picture and what is derived from it
# are not made again.
_PICTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SYNC_COMMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # bridge -> the weight sync's default-group comm


def _picture(bridge, everyone: list[list[dict]]) -> _Picture:
    kept = _PICTURES.get(bridge)
    if kept is not None and kept[0] == everyone:  # fast when a kept gather answered: its very lists
        _PICTURES[bridge] = (everyone, kept[1])  # the latest gather's lists, so that the next compare is fast too
        return kept[1]
    holders: dict[tuple[str, int], list[int]] = defaultdict(list)
    meta: dict[str, _Shard] = {}
    for holder, fields in enumerate(everyone):
        for shard in (_Shard(**{**f, "shape": tuple(f["shape"])}) for f in fields):
            holders[(shard.te_name, shard.index)].append(holder)
            meta.setdefault(shard.te_name, shard)
    te_names = sorted(meta, key=_natural_key)
    picture = _Picture(dict(holders), meta, te_names, {te: mbridge_internals.hf_names(bridge, te) for te in te_names})
    _PICTURES[bridge] = (everyone, picture)
    return picture


@dataclasses.dataclass
class _FilePlan:
    """The parallel save's steps 2 and 3: which HF tensor goes into which file, which rank writes each file, and
    the rounds in which the writers receive the pieces they lack: per round, each writer's file with its
    transfers (piece, source rank, writer, tag)."""

    plan: dict[str, str]
    names: dict[str, set[str]]
    te_for_file: dict[str, list[str]]
    rounds: list[list[tuple[int, str, list[tuple[tuple[str, int], int, int, int]]]]]


def _file_plan(picture: _Picture, source_index: Mapping, world_size: int) -> _FilePlan:
    """The file plan of ``picture``: the source checkpoint's index, else about one file per rank; each file's
    writer balancing bytes per rank and preferring the rank that holds most of the file's pieces. Kept with the
    picture for the same source index."""
    kept = picture.plans.get(("files", world_size))
    if kept is not None and kept[0] is source_index:  # the bridge's index is replaced, never changed in place
        return kept[1]
    meta, holders, hf_names = picture.meta, picture.holders, picture.hf_names
    plan = dict(source_index.get("weight_map") or {}) or _default_plan(hf_names, meta, world_size)
    names: dict[str, set[str]] = defaultdict(set)
    for name, file in plan.items():
        names[file].add(name)
    te_for_file = {file: [te for te in picture.te_names if names[file].intersection(hf_names[te])] for file in names}
    file_bytes = {f: sum(meta[te].nbytes * meta[te].count for te in tes) for f, tes in te_for_file.items()}
    load = [0] * world_size
    writer_files: list[list[str]] = [[] for _ in range(world_size)]
    for file in sorted(names, key=lambda f: (-file_bytes[f], f)):
        local = [0] * world_size
        for te in te_for_file[file]:
            for key in picture.pieces(te):
                for holder in holders[key]:
                    local[holder] += meta[te].nbytes
        writer = min(range(world_size), key=lambda r: (load[r] - local[r], r))
        load[writer] += file_bytes[file]
        writer_files[writer].append(file)
    rounds, tag = [], 0
    for round_index in range(max(len(f) for f in writer_files)):
        jobs = []
        for writer, file in ((w, fs[round_index]) for w, fs in enumerate(writer_files) if round_index < len(fs)):
            transfers = []
            for te in te_for_file[file]:
                for key in picture.pieces(te):
                    tag += 1
                    source = writer if writer in holders[key] else holders[key][0]
                    if source != writer:
                        transfers.append((key, source, writer, tag))
            jobs.append((writer, file, transfers))
        rounds.append(jobs)
    files = _FilePlan(plan, dict(names), te_for_file, rounds)
    picture.plans[("files", world_size)] = (source_index, files)
    return files


def _gather_holdings(bridge, models: list, comm: RankComm) -> _Holdings:
    """Step 1, one ``all_gather_object``: every rank learns what every rank holds (as JSON data: a forked
    group's messages are never unpickled); on a group kept across saves (``RankComm.keep_gathers``: the sync
    save's export group, the weight sync's), from the next call on the ranks only confirm that nothing changed."""
    my_shards, my_tensors = _local_shards(bridge, models)
    everyone = comm.gather_unless_unchanged("holdings", [shard.as_data() for shard in my_shards])
    device = next(iter(my_tensors.values())).device if my_tensors else torch.device("cpu")
    return _Holdings(_picture(bridge, everyone), my_tensors, device)


def gather_hf_weights(bridge, models: list, receivers: list[int]) -> dict[str, torch.Tensor]:
    """Every HF tensor of the model, whole, on each rank in ``receivers``; an empty dict on the others.

    In-memory counterpart of the parallel save (a rollout engine's weight sync): one ``all_gather_object``
    of what every rank holds (from the second call on, while nothing changed, one all-reduce that confirms it),
    then one batch of point-to-point transfers in which each receiver gets
    every piece it lacks from one holder, then the bridge's own merge and HF conversion on the receivers
    (the same tensors as mbridge's ``export_weights``, which instead broadcasts and all-gathers every
    parameter separately on every rank). Every rank must call it. A returned tensor may share storage
    with a parameter this rank holds: use it before that storage is offloaded or changed.
    """
    comm = _SYNC_COMMS.get(bridge)
    if comm is None:  # kept with the bridge: from the second sync on, unchanged holdings are only confirmed
        comm = _SYNC_COMMS[bridge] = RankComm(keep_gathers=True)
    rank = comm.rank
    held = _gather_holdings(bridge, models, comm)
    picture = held.picture
    received: dict[tuple[str, int], torch.Tensor] = {}
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    tag = 0
    for order, receiver in enumerate(receivers):
        for te in picture.te_names:
            for key in picture.pieces(te):
                tag += 1
                holders = picture.holders[key]
                if receiver in holders:
                    continue
                source = holders[order % len(holders)]  # spread the sending over the replicas
                if rank == source:
                    sends.append((held.my_tensors[key].detach().contiguous(), receiver, tag))
                elif rank == receiver:
                    shard = picture.meta[te]
                    received[key] = torch.empty(shard.shape, dtype=_dtype(shard.dtype), device=held.device)
                    recvs.append((received[key], source, tag))
    comm.exchange(sends, recvs)
    if rank not in receivers:
        return {}
    weights: dict[str, torch.Tensor] = {}
    for te in picture.te_names:
        pieces = [held.my_tensors[key].detach() if key in held.my_tensors else received[key] for key in picture.pieces(te)]
        weights.update(_to_hf(bridge, te, picture.meta[te], pieces))
    return weights


def _to_hf(bridge, te: str, shard: _Shard, pieces: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One Megatron parameter from its pieces, as HF tensors, with the bridge's own merge and conversion."""
    if shard.merge:
        # What mbridge's own save hands its merge as ``param``: a tensor with the TP attributes.
        ref = torch.empty(0, dtype=pieces[0].dtype)
        ref.tensor_model_parallel = True
        if shard.partition_dim is not None:
            ref.partition_dim = shard.partition_dim
        merged = mbridge_internals.merge_across_tp(bridge, te, pieces, ref)
    else:
        merged = pieces[0]
    return dict(zip(*mbridge_internals.to_hf_format(bridge, te, merged), strict=True))


def save_weights_in_parallel(bridge, models: list, weights_path: str, comm: RankComm | None = None) -> list[str]:
    """Write the HF folder ``weights_path``; every rank of ``comm`` (default: the default group) calls this.
    Returns the files this rank wrote (its safetensors files; on rank 0 also the index and a ``config.json`` it
    wrote), which the caller makes durable in this process."""
    comm = comm or RankComm()
    rank, world_size = comm.rank, comm.world_size
    failure: Exception | None = None  # this rank's write failed: it still sends its shards, writes nothing more
    try:
        os.makedirs(weights_path, exist_ok=True)
    except OSError as exc:
        failure = exc

    # 1. who holds what
    held = _gather_holdings(bridge, models, comm)
    my_tensors, meta = held.my_tensors, held.picture.meta

    # 2.-3. the shard plan and the rounds of each file's writer (made once while the holdings stay the same)
    source_index = getattr(getattr(bridge, "safetensor_io", None), "origin_index", None) or _NO_SOURCE_INDEX
    files = _file_plan(held.picture, source_index, world_size)

    # 4. rounds: shards to writers, merge, convert, write (over a host-only group, from host copies: the
    # file write needs them there anyway)
    written: dict[str, int] = {}
    files_written: list[str] = []
    device = torch.device("cpu") if comm.host_only else held.device
    for jobs in files.rounds:
        received: dict[tuple[str, int], torch.Tensor] = {}
        sends: list[Transfer] = []
        recvs: list[Transfer] = []
        for key, source, writer, tag in (transfer for _, _, transfers in jobs for transfer in transfers):
            if rank == source:
                sends.append((my_tensors[key].detach().contiguous().to(device), writer, tag))
            elif rank == writer:
                shard = meta[key[0]]
                received[key] = torch.empty(shard.shape, dtype=_dtype(shard.dtype), device=device)
                recvs.append((received[key], source, tag))
        comm.exchange(sends, recvs)  # one batch per round
        for writer, file, _ in jobs:
            if writer == rank and failure is None:
                try:
                    sizes = _write_file(bridge, weights_path, file, files.names[file], files.te_for_file[file], meta, my_tensors, received, device)
                    written.update(sizes)
                    files_written += [os.path.join(weights_path, file)] if sizes else []
                except Exception as exc:  # a full disk, say: reported to every rank in step 5, not left to hang them
                    failure = exc
        del received

    # 5. index and config, once every rank wrote its files
    reports = comm.agree(failure, "write its HF files", share=written)  # the outcomes, then the sizes (unless unchanged)
    index_failure = None
    if rank == 0:
        try:
            files_written += _write_index_and_config(bridge, weights_path, files.plan, source_index, {n: b for report in reports for n, b in report.items()})
        except Exception as exc:
            index_failure = exc
    comm.agree(index_failure, "write the HF index")
    return files_written


def _write_index_and_config(bridge, weights_path: str, plan: dict, source_index: Mapping, sizes: dict[str, int]) -> list[str]:
    """Rank 0: the index (the source's verbatim, as mbridge writes it, or a new one) and a missing ``config.json``;
    the files it wrote."""
    missing = sorted(set(plan) - set(sizes), key=_natural_key)
    shared = set(mbridge_internals.hf_shared_weight_keys(bridge))
    if set(missing) - shared:
        warnings.warn(f"HF export: {len(missing)} planned tensors were not produced: {missing[:20]}", stacklevel=4)
    if source_index:
        with open(os.path.join(weights_path, INDEX_FILENAME), "w") as handle:
            json.dump(source_index, handle)  # as mbridge's SafeTensorIO.save_index writes it
    else:
        weight_map = {name: plan[name] for name in sorted(sizes, key=_natural_key)}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        with open(os.path.join(weights_path, INDEX_FILENAME), "w") as handle:
            json.dump(index, handle, indent=2)
    written = [os.path.join(weights_path, INDEX_FILENAME)]
    if not os.path.exists(os.path.join(weights_path, "config.json")):
        bridge.hf_config.save_pretrained(weights_path)
        written.append(os.path.join(weights_path, "config.json"))
    return written


def _write_file(bridge, weights_path, file, names, te_list, meta, my_tensors, received, device) -> dict[str, int]:
    out: dict[str, torch.Tensor] = {}
    for te in te_list:
        pieces = [my_tensors[(te, i)].detach().to(device) if (te, i) in my_tensors else received[(te, i)] for i in range(meta[te].count)]
        for name, tensor in _to_hf(bridge, te, meta[te], pieces).items():
            if name in names:
                out[name] = tensor.contiguous().cpu()
    if out:
        save_file(out, os.path.join(weights_path, file))
        start_writeback(os.path.join(weights_path, file))  # the disk writes it while the next file is converted
    return {name: tensor.numel() * tensor.element_size() for name, tensor in out.items()}
