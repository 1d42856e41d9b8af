"""``merge --backend megatron``: one checkpoint step -> a complete, verified HF model folder.

With ``use_dist_checkpointing=True`` a step holds the model only as Megatron shards (of whatever TP/PP/EP
layout it was trained at), so nothing outside Megatron can read it; this rebuilds the model on one CPU rank
through this package's bridge, loads the shards (megatron reshards on load) and writes HF weights. A step
whose model is already HF (upstream's default) is copied. Either way the folder is checked against the
tensors its config implies before it appears at ``target_dir``: the folder is written beside it and renamed
into place only once whole, so a failed merge leaves nothing that looks like a model.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from typing import Any

from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
from verl.utils.checkpoint.integrity import (
    CheckpointError,
    find_resume_checkpoint,
    read_saved_layout,
    verify_checkpoint,
)
from verl.utils.checkpoint.layout import HF_DIR
from verl.utils.custom_code import CustomCodeError, is_code_file, refuse_custom_code

STAGING_SUFFIX = ".merging"
# Weight files (and their indexes) are never copied beside the ones this merge writes.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


class MergeError(RuntimeError):
    """The merge cannot go on; the message names the problem and the fix. ``exit_code``: 2 for a usage
    problem (paths, options), 1 for a damaged checkpoint or a merged folder that fails verification."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _progress(message: str) -> None:
    print(f"[merge] {message}", flush=True)


def resolve_step(local_dir: str) -> str:
    """The step directory to merge: ``local_dir`` itself, or the step a run directory's tracker names."""
    if not os.path.exists(local_dir):
        raise MergeError(f"--local_dir {local_dir} does not exist; pass a global_step_N/actor directory", exit_code=2)
    if os.path.isfile(get_checkpoint_tracker_filename(local_dir)):
        path, notes = find_resume_checkpoint(local_dir)
        for note in notes:
            _progress(f"note: {note}")
        if path is None:
            raise MergeError(f"{local_dir} tracks no step; pass a global_step_N/actor directory", exit_code=2)
        _progress(f"{local_dir} tracks {path}")
        return path
    return local_dir


def check_target(target_dir: str) -> None:
    """Refuse a target that holds anything: upstream has no overwrite option, and merging into a model
    folder would mix two models' files."""
    if os.path.isdir(target_dir) and os.listdir(target_dir):
        raise MergeError(f"--target_dir {target_dir} is not empty; remove it or pass a new directory", exit_code=2)
    if os.path.exists(target_dir) and not os.path.isdir(target_dir):
        raise MergeError(f"--target_dir {target_dir} exists and is not a directory; pass a directory path", exit_code=2)


def _content_path(step: str, contents: dict, name: str, default: str) -> str:
    """Where ``ckpt_contents.json`` (upstream's schema) puts a content, relative paths resolved in the step."""
    entry = contents.get("contents", {}).get(name, {})
    return os.path.join(step, entry.get("path", default))


def _has_hf_config(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def _copy_non_weight_files(source: str, target: str) -> list[str]:
    """config.json, generation config, tokenizer and any other top-level file that is neither a weight file nor
    code (a folder this package writes holds no code: ``verl.utils.custom_code``)."""
    copied = []
    for name in sorted(os.listdir(source)):
        full = os.path.join(source, name)
        if os.path.isfile(full) and not name.endswith(_WEIGHT_SUFFIXES) and not is_code_file(name):
            shutil.copy2(full, os.path.join(target, name))
            copied.append(name)
    return copied


def saved_model_dtype(dist_ckpt_dir: str):
    """The dtype the model's shards were saved in (megatron's model state holds the parameters at the
    training dtype), read from the torch_dist metadata, so the rebuilt model loads them without a cast."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from verl.utils.checkpoint.data_only import METADATA_FILENAME, read_dcp_metadata

    metadata = read_dcp_metadata(os.path.join(dist_ckpt_dir, METADATA_FILENAME))
    dtypes = Counter(
        entry.properties.dtype
        for entry in metadata.state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata) and entry.properties.dtype.is_floating_point
    )
    if not dtypes:
        raise MergeError(f"{dist_ckpt_dir} holds no floating-point tensors: it is not a model checkpoint")
    return dtypes.most_common(1)[0][0]


def _start_single_rank(seed: int = 1234) -> None:
    """Join a one-process gloo group and initialise megatron's parallel state at TP=PP=EP=1."""
    from verl.utils.distributed import find_free_port, init_rank
    from verl.utils.megatron.parallel import ParallelSizes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    init_rank(0, 1, ParallelSizes(), seed=seed, timeout_s=3600.0)


def _stop_single_rank() -> None:
    import torch
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _export_dist_checkpoint(step: str, contents: dict, config_dir: str, staging: str) -> None:
    """Build the model from ``config_dir``'s HF config on this rank, load the step's model shards into it
    through the checkpoint manager, write the HF weights through the bridge."""
    from verl.models.mcore import UnsupportedHFConfigError, load_hf_config, make_bridge
    from verl.models.mcore.model import build_megatron_model
    from verl.utils.checkpoint.integrity import check_model_identity
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    dist_ckpt = _content_path(step, contents, "model", os.path.join("model", "dist_ckpt"))
    dtype = saved_model_dtype(dist_ckpt)
    hf_config = load_hf_config(config_dir, where=f"the HF config folder {config_dir}")
    _progress(f"building {hf_config.architectures[0] if hf_config.architectures else hf_config.model_type} ({dtype}) from {config_dir}/config.json on one CPU rank")
    _start_single_rank()
    try:
        try:
            bridge = make_bridge(hf_config, dtype=dtype)
        except UnsupportedHFConfigError as exc:
            raise MergeError(f"the bridge cannot build the model of {config_dir}/config.json: {exc}; only bridge-supported models merge here", exit_code=2) from exc
        try:
            check_model_identity(step, bridge.config)  # a config of another model fails here, not mid-load
        except CheckpointError as exc:
            differences = "; ".join(line.strip().removeprefix("- ") for line in str(exc).splitlines()[1:])
            raise MergeError(f"{config_dir} is not the model {step} was trained from ({differences}); pass --hf_model_path <that model>", exit_code=2) from exc
        model = build_megatron_model(bridge, wrap_with_ddp=False)
        manager = MegatronCheckpointManager(
            config={"model": {"path": config_dir}},
            checkpoint_config={"save_contents": [], "load_contents": ["model"]},
            model_config=hf_config,
            transformer_config=bridge.config,
            role=contents.get("role", "actor"),
            model=model,
            arch=hf_config.architectures[0] if hf_config.architectures else None,
            hf_config=hf_config,
            param_dtype=dtype,
            share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
            processing_class=None,
            optimizer=None,
            optimizer_scheduler=None,
            use_distributed_optimizer=False,
            use_dist_checkpointing=True,
            bridge=bridge,
        )
        layout = read_saved_layout(step)
        _progress(f"loading the model shards from {dist_ckpt} (saved at {layout or 'an unrecorded layout'}; resharded to 1 rank)")
        start = time.monotonic()
        manager.load_checkpoint(step)
        _progress(f"  loaded in {time.monotonic() - start:.1f}s")
        _progress(f"writing HF weights to {staging}")
        start = time.monotonic()
        bridge.save_weights(model, staging)
        _progress(f"  written in {time.monotonic() - start:.1f}s")
    finally:
        _stop_single_rank()


def _verify_folder(staging: str) -> int:
    from verl.utils.checkpoint.hf_verify import verify_hf_checkpoint

    _progress("verifying the HF folder against the tensors its config implies")
    report = verify_hf_checkpoint(staging)
    if not report.ok:
        raise MergeError(f"the merged folder failed verification, nothing was written to the target: {report.describe(limit=20)}")
    return report.expected


def _commit(staging: str, target_dir: str) -> None:
    """Rename the verified folder into place (an empty target directory, as upstream creates, is replaced)."""
    if os.path.isdir(target_dir):
        os.rmdir(target_dir)  # check_target saw it empty
    os.rename(staging, target_dir)


def merge_megatron_step(local_dir: str, target_dir: str, hf_model_path: str | None = None, tie_word_embedding: bool = False) -> str:
    """Turn the step at ``local_dir`` into a verified HF folder at ``target_dir``; returns the path written.

    Raises MergeError (or CheckpointError / FileNotFoundError for a damaged step) before writing anything
    at ``target_dir``.
    """
    started = time.monotonic()
    step = resolve_step(local_dir)
    check_target(target_dir)
    _progress(f"checking {step} (manifest, contents)")
    contents = verify_checkpoint(step)
    model = contents.get("contents", {}).get("model")
    if model is None:
        raise MergeError(f"{step} was saved without its model (save_contents {contents.get('save_contents')}); merge a step saved with 'model'")

    staging = os.path.abspath(target_dir).rstrip(os.sep) + STAGING_SUFFIX
    if os.path.exists(staging):
        _progress(f"removing {staging}, left by an interrupted merge")
        shutil.rmtree(staging)
    os.makedirs(staging)
    try:
        if model.get("format") == "huggingface":
            source = _content_path(step, contents, "model", HF_DIR)
            _progress(f"the model is already HF (use_dist_checkpointing=False): copying {source}")
            if hf_model_path:
                _progress("note: --hf_model_path is not used, the step holds its own HF folder")
            shutil.rmtree(staging)
            shutil.copytree(source, staging, ignore=lambda _, names: [n for n in names if is_code_file(n)])
            config_dir = staging
        elif model.get("format") == "megatron_dist_checkpoint":
            config_dir = _hf_config_dir(step, contents, hf_model_path)
            _check_tie(config_dir, tie_word_embedding)
            copied = _copy_non_weight_files(config_dir, staging)  # the config first, as a save writes it
            _progress(f"copied {', '.join(copied)} from {config_dir}")
            _export_dist_checkpoint(step, contents, config_dir, staging)
        else:
            raise MergeError(f"{step}: model format {model.get('format')!r} is not one this merge reads (huggingface, megatron_dist_checkpoint)")
        expected = _verify_folder(staging)
        _commit(staging, target_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _progress(f"OK: {target_dir} holds all {expected} tensors of the model (step {contents.get('global_step')}) in {time.monotonic() - started:.1f}s")
    return target_dir


def _hf_config_dir(step: str, contents: dict, hf_model_path: str | None) -> str:
    """The step's own HF config folder (written with 'hf_model' or an HF model), else ``--hf_model_path``."""
    own = _content_path(step, contents, "hf_config", HF_DIR)
    if _has_hf_config(own):
        if hf_model_path:
            _progress(f"note: --hf_model_path is not used, the step holds its own HF config ({own})")
        return own
    if not hf_model_path:
        raise MergeError(
            f"{step} holds no HF config (saved with use_dist_checkpointing=True and without 'hf_model'); "
            "pass --hf_model_path <the HF model it was trained from>",
            exit_code=2,
        )
    if not _has_hf_config(hf_model_path):
        raise MergeError(f"--hf_model_path {hf_model_path} has no config.json; pass the HF model directory the run started from", exit_code=2)
    try:
        refuse_custom_code(hf_model_path, f"--hf_model_path {hf_model_path}", "pass the built-in HF model the run started from (--trust-remote-code does not change this)")
    except CustomCodeError as exc:
        raise MergeError(str(exc), exit_code=2) from None
    return hf_model_path


def _check_tie(config_dir: str, tie_word_embedding: bool) -> None:
    """Upstream's flag says the model ties its embeddings; here the config decides, so refuse a contradiction."""
    if not tie_word_embedding:
        return
    import json

    with open(os.path.join(config_dir, "config.json")) as handle:
        tied = bool(json.load(handle).get("tie_word_embeddings", False))
    if not tied:
        raise MergeError(
            f"--tie-word-embedding was given but {config_dir}/config.json has tie_word_embeddings=false; "
            "the config decides here: drop the flag",
            exit_code=2,
        )


def merge(args: Any) -> int:
    """The ``merge`` subcommand: refuse what this package does not do, then merge."""
    if args.backend == "fsdp":
        raise MergeError("--backend fsdp is not supported here: this package saves Megatron checkpoints only; use --backend megatron", exit_code=2)
    if args.local_dir is None:
        raise MergeError("--local_dir is required: pass a global_step_N/actor directory", exit_code=2)
    if args.is_value_model:
        raise MergeError("--is-value-model is not supported here: this package saves actor (causal LM) checkpoints only", exit_code=2)
    world = os.environ.get("WORLD_SIZE")
    if world not in (None, "1"):
        raise MergeError(f"merge runs as one process (WORLD_SIZE={world}); run it without torchrun", exit_code=2)
    if args.hf_upload_path:
        raise MergeError("--hf_upload_path is not supported here (no network upload); upload target_dir with `huggingface-cli upload`", exit_code=2)
    try:
        merge_megatron_step(args.local_dir, args.target_dir, hf_model_path=args.hf_model_path, tie_word_embedding=args.tie_word_embedding)
    except (CheckpointError, FileNotFoundError) as exc:
        raise MergeError(f"{exc}; merge a complete step (check it with `python -m verl.model_merger verify --local_dir ...`)") from exc
    return 0
