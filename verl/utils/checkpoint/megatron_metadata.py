"""The metadata files of a ``MegatronCheckpointManager`` step: upstream's ``ckpt_contents.json`` (what each
content is, where it lies, in which format) and ``transformer_config.json`` (what the model-identity check
reads at resume). Rank 0 writes both once the parts are on disk, ``ckpt_contents.json`` last, each whole or not
at all but not fsynced: they go into a step's staging directory, where rank 0's commit fsyncs what it wrote
before its rename (``durability``; an fsync here waited for the journal behind the dist files' writeback). Also the HF
folder's non-weight files (``write_hf_config``), which rank 0 writes before any HF weight, in the rank or a fork.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

from verl.utils.checkpoint import layout
from verl.utils.fs import atomic_open

CKPT_CONTENTS_SCHEMA_VERSION = 2  # upstream's ckpt_contents.json schema


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def _write_json(path: str, data: dict, **dump_options: Any) -> None:
    """``data`` into ``path`` whole or not at all, not fsynced (rank 0's commit fsyncs it: ``durability``)."""
    with atomic_open(path, "w", durable=False) as handle:
        json.dump(data, handle, **dump_options)


def write_hf_config(hf_path: str, processing_class: Any, hf_config: Any, model_path: str | None) -> None:
    """Everything the HF folder needs besides the weights (tokenizer, config, generation config), written first."""
    if processing_class is not None:
        processing_class.save_pretrained(hf_path)
    hf_config.save_pretrained(hf_path)
    generation_config = os.path.join(model_path or "", "generation_config.json")
    if model_path and os.path.isfile(generation_config):
        shutil.copyfile(generation_config, os.path.join(hf_path, "generation_config.json"))


class MegatronMetadata:
    """The manager's metadata writers (a mixin over its contents flags, configs and role)."""

    def _save_transformer_config(self, local_path: str) -> None:
        """Rank 0: the Megatron TransformerConfig as JSON (what the model-identity check reads at resume)."""
        if self.rank != 0:
            return
        config = self.transformer_config
        names = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) else list(vars(config))
        fields = {name: _json_safe(getattr(config, name)) for name in names if not callable(getattr(config, name))}
        _write_json(os.path.join(local_path, layout.TRANSFORMER_CONFIG_FILENAME), fields, indent=2)

    def _build_checkpoint_manifest(self, local_path: str, global_step: int) -> dict:
        """``ckpt_contents.json``: what each content is, where it lies (relative paths) and in which format."""
        hf, dist, transformer_config = layout.HF_DIR, layout.DIST_CKPT_DIRS, layout.TRANSFORMER_CONFIG_FILENAME
        # every content directory exists, as upstream's get_*_path helpers leave it: an empty model/dist_ckpt is
        # part of upstream's layout
        for directory in (hf, *dist.values()):
            os.makedirs(os.path.join(local_path, directory), exist_ok=True)
        contents: dict[str, dict] = {}
        directories: dict[str, str] = {}
        if self.should_save_hf_model:
            if not self.should_save_dist_ckpt_model:
                contents["model"] = {"path": hf, "format": "huggingface", "backend": "mbridge"}
            if "hf_model" in self.checkpoint_save_contents:
                note = layout.CONTENT_NOTES["hf_model_beside_dist" if self.should_save_dist_ckpt_model else "hf_model_same_files"]
                contents["hf_model"] = {"path": hf, "format": "huggingface", "note": note}
            directories[hf] = layout.DIRECTORY_NOTES["hf"]
        if self.should_save_dist_ckpt_model:
            contents["model"] = {"path": dist["model"], "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"}
            directories[dist["model"]] = layout.DIRECTORY_NOTES["model"]
        if self.should_save_optimizer:
            contents["optimizer"] = {"path": dist["optimizer"], "format": "megatron_dist_checkpoint"}
            if self.lr_scheduler is not None:
                contents["lr_scheduler"] = {"path": dist["optimizer"], "format": "megatron_dist_checkpoint", "key": "lr_scheduler"}
            directories[dist["optimizer"]] = layout.DIRECTORY_NOTES["optimizer"]
        if self.should_save_extra:
            contents["rng_state"] = {"path": dist["extra"], "format": "megatron_dist_checkpoint", "key": "rng_state"}
            contents["transformer_config"] = {"path": transformer_config, "format": "json"}
            directories[dist["extra"]] = layout.DIRECTORY_NOTES["extra"]
        if self.should_save_hf_model:
            contents["hf_config"] = {"path": hf, "format": "huggingface", "note": layout.CONTENT_NOTES["hf_config"]}
            if self.processing_class is not None:
                contents["tokenizer"] = {"path": hf, "format": "huggingface"}
        # a staging directory is committed by the step transaction, which writes the manifest and mark named there
        integrity = layout.INTEGRITY_NOTE if layout.is_staging_path(local_path) else layout.INTEGRITY_IN_PLACE_NOTE
        return {
            "schema_version": CKPT_CONTENTS_SCHEMA_VERSION,
            "framework": "megatron",
            "role": self.role,
            "arch": self.arch,
            "global_step": int(global_step),
            "world_size": self.world_size,
            "backend": {"has_bridge": self.bridge is not None, "use_dist_checkpointing": self.use_dist_checkpointing, "peft": False},
            "save_contents": list(self.checkpoint_save_contents),
            "contents": contents,
            "directories": directories,
            "saved_any_dist_ckpt": bool(self._dist_contents()),
            layout.INTEGRITY_KEY: dict(integrity),
        }

    def _write_checkpoint_manifest(self, local_path: str, global_step: int) -> None:
        """Rank 0, last: ``ckpt_contents.json``."""
        if self.rank != 0:
            return
        contents = self._build_checkpoint_manifest(local_path, global_step)
        _write_json(os.path.join(local_path, layout.CONTENTS_FILENAME), contents, indent=2, sort_keys=True)
