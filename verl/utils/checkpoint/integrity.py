"""Is a checkpoint step whole, and which one does a resume take?

A step is committed by renaming its staging directory (``<actor>.incomplete``) into place after
every rank finished every part; its ``manifest.json`` (ours, written last inside the staging directory;
upstream verl ignores it) lists every file with its size and the parallel layout it was saved at. A load
checks the manifest first, so a truncated shard, a deleted metadata file or a foreign model fails with the
file and the cause named, before anything loads. A step without a manifest and commit mark was saved by
upstream verl (or in place by upstream's API, the manager's own ``save_checkpoint``, which commits nothing): it
loads with a warning, checked only as far as its own files allow; unless it holds what only a committed step of
this package holds (``our_marks``): then it is a step of ours stripped of them, and refused.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
from verl.utils.checkpoint.checksum import crc32, file_checksum, is_bulk  # noqa: F401 (crc32, file_checksum: also imported from here)
from verl.utils.checkpoint.errors import (  # CheckpointError: this import path kept for callers
    CheckpointError,
    ChecksumMismatchError,
)
from verl.utils.checkpoint.layout import (  # the manifest, mark and staging names are also imported from here
    COMMIT_MARK_FILENAME,
    CONTENT_NOTES,
    CONTENTS_FILENAME,
    DIRECTORY_NOTES,
    INTEGRITY_IN_PLACE_NOTE,
    INTEGRITY_KEY,
    MANIFEST_FILENAME,
    RANK_RNG_STATE_KEY,
    STAGING_SUFFIX,
    STEP_DIR_FORMAT,
    STEP_DIR_RE,
    TRANSFORMER_CONFIG_FILENAME,
    hf_path,
    list_step_dirs,
    superseded_path,
)
from verl.utils.checkpoint.tracker import read_tracker
from verl.utils.megatron.layer_pattern import megatron_moe_layers

FORMAT_VERSION = 2  # each file's size and content checksum (1, sizes only, is refused: it cannot vouch for bytes)
_CHECKSUM_RE = re.compile(r"crc32:[0-9a-f]{8}")
# the manifest's record of its HF export found complete at the save: a resume checks the export's headers against
# it instead of deriving the expected tensors again (``hf_verify.export_proof``)
HF_EXPORT_KEY = "hf_export"
# TransformerConfig fields that make two models incompatible (a checkpoint of one cannot load into the other).
MODEL_IDENTITY_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "qk_layernorm",
    "gated_linear_unit",
)


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writing back the dirty pages, do not wait
_LIBC_SYNC_FILE_RANGE = getattr(ctypes.CDLL(None), "sync_file_range", None)  # Linux only; elsewhere a no-op
if _LIBC_SYNC_FILE_RANGE is not None:
    _LIBC_SYNC_FILE_RANGE.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(path: str) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk now, without waiting (``sync_file_range``):
    the pages stay cached, and the fsync that makes the file durable later finds them written or in flight
    instead of starting the whole write then. A hint only (a failure is ignored): durability is the fsync's."""
    if _LIBC_SYNC_FILE_RANGE is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # a file that cannot be opened is the checksum's and the commit's to report, not a hint's
    try:
        _LIBC_SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)


def start_range_writeback(fd: int, offset: int, length: int) -> None:
    """``start_writeback`` for ``length`` bytes from ``offset`` of an open file (0: to its end); the kernel may
    block the caller while its write queue is full, which paces a writer to the disk."""
    if _LIBC_SYNC_FILE_RANGE is not None:
        _LIBC_SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def files_under(step_path: str, directories: list[str]) -> list[str]:
    """Every file below ``directories`` (paths inside ``step_path``), relative to ``step_path``, sorted."""
    return sorted(
        os.path.relpath(os.path.join(root, name), step_path)
        for directory in directories
        for root, _, names in os.walk(directory)
        for name in names
    )


def _step_files(step_path: str) -> list[str]:
    """Every file of the step but the manifest itself, relative to it."""
    return [r for r in files_under(step_path, [step_path]) if r != MANIFEST_FILENAME]


def _checksums(paths: list[str]) -> list[str]:
    """CRC-32 of each file, several at once (``crc32`` runs without the GIL, so threads use every core)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(file_checksum, paths))


@dataclasses.dataclass(frozen=True)
class BridgeRecord:
    """The bridge a step was written through and the layer spec it built the model from (manifest.json's
    ``bridge``): together they decide the module names in the step's dist checkpoints (the optimizer state's
    always, the model's with use_dist_checkpointing=True); HF weights carry HF's names whichever wrote them."""

    name: str  # "mbridge" or "Megatron-Bridge"
    layer_spec: str  # "local" (megatron-core's local modules) or "transformer_engine"

    NAMES = ("mbridge", "Megatron-Bridge")
    LAYER_SPECS = ("local", "transformer_engine")

    def is_known(self) -> bool:
        """Whether the record names a bridge and a layer spec this package builds with."""
        return self.name in self.NAMES and self.layer_spec in self.LAYER_SPECS

    @classmethod
    def of_step(cls, manifest: dict | None) -> BridgeRecord | None:
        """The record a step's manifest holds; None for a step saved before it was recorded, or by upstream."""
        saved = (manifest or {}).get("bridge")
        if not isinstance(saved, dict) or not all(isinstance(saved.get(f.name), str) for f in dataclasses.fields(cls)):
            return None
        return cls(saved["name"], saved["layer_spec"])


def build_manifest(
    step_path: str,
    parallel: dict | None = None,
    use_distributed_optimizer: bool | None = None,
    known_checksums: dict[str, str] | None = None,
    bridge: BridgeRecord | None = None,
    hf_export: dict | None = None,
) -> dict:
    """Every file of the step (relative path -> size and content checksum), the layout it was saved at, the
    bridge that wrote it and ``hf_export``, the proof of its HF export found complete (``hf_verify.export_proof``).
    ``known_checksums``: files (relative paths) already hashed since they were complete; the rest is hashed here."""
    known = known_checksums or {}
    relative = _step_files(step_path)
    todo = [r for r in relative if r not in known]
    hashed = dict(zip(todo, _checksums([os.path.join(step_path, r) for r in todo]), strict=True))
    files = {r: {"size": os.path.getsize(os.path.join(step_path, r)), "checksum": known.get(r) or hashed[r]} for r in relative}
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    if parallel is not None:
        manifest["parallel"] = parallel
        manifest["use_distributed_optimizer"] = use_distributed_optimizer
    if bridge is not None:
        manifest["bridge"] = dataclasses.asdict(bridge)
    if hf_export is not None:
        manifest[HF_EXPORT_KEY] = hf_export
    return manifest


def read_manifest(step_path: str) -> dict | None:
    """The step's manifest.json; None when the step has none (saved by upstream verl)."""
    path = os.path.join(step_path, MANIFEST_FILENAME)
    return _read_json(path, "manifest") if os.path.exists(path) else None


def manifest_checksums(step_path: str) -> dict[str, str] | None:
    """Each file's checksum by its path relative to the step, as the manifest records it; None for a step without
    a manifest (saved by upstream verl: nothing records its bytes)."""
    manifest = read_manifest(step_path)
    if manifest is None:
        return None
    entries, _ = _manifest_entries(step_path, os.path.join(step_path, MANIFEST_FILENAME), manifest)
    return {os.path.normpath(relative): checksum for relative, (_, checksum) in entries.items()}


def checksums_in(checksums: dict[str, str], directory: str) -> dict[str, str]:
    """The files of ``checksums`` (``manifest_checksums``) directly inside ``directory`` (relative to the step),
    by file name."""
    directory = os.path.normpath(directory)
    return {os.path.basename(r): c for r, c in checksums.items() if os.path.dirname(r) == directory}


def verify_bulk_checksums(step_path: str, directory: str) -> None:
    """The bulk files (``checksum.is_bulk``) of ``directory`` (relative to the step) match the manifest's checksums:
    for a reader that loads them straight into the model. ``ChecksumMismatchError``, one line naming each file."""
    checksums = manifest_checksums(step_path) or {}
    listed = [(os.path.join(step_path, r), c) for r, c in sorted(checksums.items()) if is_bulk(r) and r.startswith(os.path.normpath(directory) + os.sep)]
    bad = [
        f"{full}: its content checksum differs from the manifest's {want} (changed or corrupted since the save)"
        for (full, want), got in zip(listed, _checksums([f for f, _ in listed]), strict=True)
        if got != want
    ]
    if bad:
        raise ChecksumMismatchError(f"checkpoint {step_path} is damaged: " + "; ".join(bad))


def read_saved_layout(step_path: str) -> dict | None:
    """The parallel layout (tp, pp, ep, etp, cp, world_size) the step was saved at, when its manifest says."""
    manifest = read_manifest(step_path)
    return manifest.get("parallel") if manifest else None


def _read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``; CheckpointError naming the file when it is missing, unreadable or not an
    object (``null``, a list or a number would otherwise fail later with a bare Python traceback)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is not complete (interrupted save?) or was damaged")
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} ({what}) is unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} ({what}) holds a JSON {_json_type(data)}, not the object a save writes: the file was damaged or replaced")
    return data


def _json_type(value) -> str:
    """JSON's own name for the type of a decoded value."""
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def read_ckpt_contents(step_path: str) -> dict:
    """The step's ckpt_contents.json, with a clear error when the step is absent or not a directory."""
    if not os.path.exists(step_path):
        raise FileNotFoundError(f"checkpoint {step_path} does not exist")
    if not os.path.isdir(step_path):
        raise CheckpointError(f"checkpoint {step_path} is not a directory")
    path = os.path.join(step_path, CONTENTS_FILENAME)
    data = _read_json(path, "checkpoint contents")
    contents = data.get("contents")
    well_formed = isinstance(contents, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("format"), str) for entry in contents.values()
    )
    if not well_formed:
        raise CheckpointError(f"{path}: 'contents' must be an object of content -> {{path, format}}, found {contents!r:.200}; the file was damaged or replaced")
    return data


def verify_manifest(step_path: str, required: bool = True, checksums: bool = True, bulk_checksums: bool = True) -> bool:
    """The manifest covers the step: every file it lists lies inside the step with its recorded size and, with
    ``checksums``, content checksum; every file of the step is listed; the commit mark names the step of the
    directory. False when the step has neither our commit mark nor a manifest and ``required`` is False (an
    upstream step). ``checksums=False`` is for a caller that has just hashed these very bytes (one read, not two);
    ``bulk_checksums=False`` leaves the shards and weights (``checksum.is_bulk``) to the load, which checksums them
    from the bytes it reads."""
    mark_path = os.path.join(step_path, COMMIT_MARK_FILENAME)
    if not required and not os.path.exists(mark_path) and not os.path.exists(os.path.join(step_path, MANIFEST_FILENAME)):
        marks = our_marks(step_path)
        if marks:
            raise CheckpointError(
                f"checkpoint {step_path} has neither {MANIFEST_FILENAME} nor {COMMIT_MARK_FILENAME}, yet it was saved by this "
                f"package ({'; '.join(marks)}): a step of ours whose manifest and commit mark are gone (deleted or lost), so "
                "nothing vouches for its files; resume an earlier step (trainer.resume_mode=resume_path "
                "trainer.resume_from_path=<its global_step_N>) or restore both files from a copy of this step"
            )
        return False
    manifest_path = os.path.join(step_path, MANIFEST_FILENAME)
    manifest = _read_json(manifest_path, "manifest")
    entries, problems = _manifest_entries(step_path, manifest_path, manifest)
    problems += _commit_mark_problems(step_path, mark_path)
    problems += [f"{os.path.join(step_path, f)} is missing from the manifest" for f in _required_files(step_path, entries)]
    listed = {os.path.normpath(relative) for relative in entries}
    problems += [
        f"{os.path.join(step_path, r)} is not listed in {manifest_path} (added after the save?); remove it or restore the step"
        for r in _step_files(step_path)
        if os.path.normpath(r) not in listed
    ]
    to_hash = []
    for relative, (size, checksum) in entries.items():
        full = os.path.join(step_path, relative)
        if not os.path.isfile(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, the manifest says {size} (truncated or overwritten)")
        elif checksums and (bulk_checksums or not is_bulk(relative)):
            to_hash.append((full, checksum))
    for (full, want), got in zip(to_hash, _checksums([f for f, _ in to_hash]), strict=True):
        if got != want:
            problems.append(f"{full}: its content checksum differs from the manifest's {want} (changed or corrupted since the save)")
    if problems:
        raise CheckpointError(f"checkpoint {step_path} is damaged:\n  - " + "\n  - ".join(problems))
    return True


def our_marks(step_path: str) -> list[str]:
    """What in a step only this package writes (besides the manifest and commit mark), one line per file:
    ckpt_contents.json's ``integrity`` entry, this package's own notes on its contents and descriptions of its
    ``directories``, and the per-rank RNG states (``rank_rng_state``) in a dist checkpoint's ``.metadata``.
    Upstream verl writes none of them. Empty for a step whose contents file says it was saved in place
    (``INTEGRITY_IN_PLACE_NOTE``: the manager's ``save_checkpoint`` called directly, upstream's API), which no
    manifest ever vouched for."""
    from verl.utils.checkpoint.data_only import METADATA_FILENAME, read_dcp_metadata

    marks = []
    contents_path = os.path.join(step_path, CONTENTS_FILENAME)
    if os.path.isfile(contents_path):
        data = _read_json(contents_path, "checkpoint contents")
        if data.get(INTEGRITY_KEY) == INTEGRITY_IN_PLACE_NOTE:
            return []
        if INTEGRITY_KEY in data:
            marks.append(f"{contents_path} names its '{INTEGRITY_KEY}' files, {MANIFEST_FILENAME} and {COMMIT_MARK_FILENAME}")
        entries = {**_as_dict(data.get("directories")), **{name: entry.get("note") for name, entry in _as_dict(data.get("contents")).items() if isinstance(entry, dict)}}
        ours = sorted(name for name, note in entries.items() if isinstance(note, str) and note in {*DIRECTORY_NOTES.values(), *CONTENT_NOTES.values()})
        if ours:
            marks.append(f"{contents_path} describes {', '.join(ours)} in this package's words")
    for root, _, names in sorted(os.walk(step_path)):
        if METADATA_FILENAME in names:
            path = os.path.join(root, METADATA_FILENAME)
            if RANK_RNG_STATE_KEY in {index.split("/")[0] for index in read_dcp_metadata(path).state_dict_metadata}:
                marks.append(f"{path} holds {RANK_RNG_STATE_KEY} (every rank's own RNG state)")
    return marks


def _as_dict(value) -> dict:
    """``value`` when a JSON object, else an empty one (a damaged contents file is no evidence either way)."""
    return value if isinstance(value, dict) else {}


def _manifest_entries(step_path: str, manifest_path: str, manifest: dict) -> tuple[dict[str, tuple[int, str]], list[str]]:
    """The manifest's well-formed entries (relative path -> size, checksum) and a line per entry that is not:
    a manifest that may leave out checksums, or name paths outside the step, could be made to vouch for anything."""
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        return {}, [
            f"{manifest_path}: format_version {version!r}; this package writes and accepts only {FORMAT_VERSION} (a size "
            "and a checksum for every file), so this manifest cannot vouch for the step's bytes"
        ]
    files = manifest.get("files")
    if not isinstance(files, dict):
        return {}, [f"{manifest_path}: 'files' is a JSON {_json_type(files)}, not an object of file -> size and checksum"]
    root = os.path.realpath(step_path)
    entries, problems = {}, []
    for relative, entry in files.items():
        size, checksum = (entry.get("size"), entry.get("checksum")) if isinstance(entry, dict) else (None, None)
        if not _inside(root, step_path, relative):
            problems.append(f"{manifest_path}: entry {relative!r} lies outside the step {step_path}")
        elif type(size) is not int or size < 0 or not (isinstance(checksum, str) and _CHECKSUM_RE.fullmatch(checksum)):
            problems.append(f"{manifest_path}: entry {relative!r} needs an integer 'size' and a 'checksum' (crc32:<8 hex>), found {entry!r}")
        else:
            entries[relative] = (size, checksum)
    return entries, problems


def _inside(root: str, step_path: str, relative: str) -> bool:
    """Whether ``relative`` names a path inside the step (``root`` its real path), links resolved."""
    try:
        return not os.path.isabs(relative) and os.path.commonpath([root, os.path.realpath(os.path.join(step_path, relative))]) == root
    except (TypeError, ValueError):  # not a string, or an embedded NUL
        return False


def _commit_mark_problems(step_path: str, mark_path: str) -> list[str]:
    """The commit mark exists and names the step of the directory it lies in (a step directory symlinked or
    renamed under another number is not the step its tracker asks for)."""
    try:
        mark = _read_json(mark_path, "commit mark")
    except CheckpointError as exc:
        return [str(exc)]
    marked = mark.get("global_step")
    match = STEP_DIR_RE.match(os.path.basename(os.path.dirname(os.path.abspath(step_path))))
    if type(marked) is not int:
        return [f"{mark_path}: 'global_step' is {marked!r}, not a step number"]
    if match and int(match.group(1)) != marked:
        return [f"{mark_path} says step {marked}, but the step lies in {os.path.dirname(os.path.abspath(step_path))}: a step directory renamed or linked under another number"]
    return []


def _required_files(step_path: str, files: dict[str, tuple[int, str]]) -> list[str]:
    """What a step of its contents must hold (per ckpt_contents.json) and the manifest does not list."""
    if not os.path.isfile(os.path.join(step_path, CONTENTS_FILENAME)):
        return []
    contents = read_ckpt_contents(step_path)["contents"]
    required = [CONTENTS_FILENAME]
    for name, entry in contents.items():
        if entry.get("format") == "megatron_dist_checkpoint" and name in ("model", "optimizer", "rng_state"):
            required.append(os.path.join(entry["path"], ".metadata"))
        elif entry.get("format") == "huggingface" and name in ("model", "hf_model"):
            required.append(os.path.join(entry["path"], "config.json"))
    return sorted({r for r in required if os.path.normpath(r) not in {os.path.normpath(f) for f in files}})


def check_model_identity(step_path: str, transformer_config) -> None:
    """The step was saved from the same model architecture as ``transformer_config`` (as far as it says:
    a step saved without 'extra' has no transformer_config.json)."""
    path = os.path.join(step_path, TRANSFORMER_CONFIG_FILENAME)
    if not os.path.exists(path):
        return
    saved = _read_json(path, "transformer config")
    differences = [
        f"{field}: checkpoint {saved.get(field)!r}, this model {getattr(transformer_config, field, None)!r}"
        for field in MODEL_IDENTITY_FIELDS
        if field in saved and saved.get(field) != getattr(transformer_config, field, None)
    ]
    if not differences and "moe_layer_freq" in saved:  # an int and a list can name the same layers
        layers = [
            megatron_moe_layers(
                getattr(config, "moe_layer_freq", 1), getattr(config, "num_layers", 0), getattr(config, "num_moe_experts", None)
            )
            for config in (SimpleNamespace(**saved), transformer_config)
        ]
        if layers[0] != layers[1]:
            differences.append(f"MoE layers (moe_layer_freq, 1 = routed experts): checkpoint {layers[0]}, this model {layers[1]}")
    if differences:
        raise CheckpointError(
            f"checkpoint {step_path} is of a different model; set actor_rollout_ref.model.path to the model it was "
            "trained from, or point trainer.resume_from_path at a checkpoint of this model:\n  - " + "\n  - ".join(differences)
        )


def is_complete(step_path: str) -> bool:
    """Whether the step holds its contents file and every file its manifest lists, at its size (no checksums:
    this only tells a committed step from an interrupted one)."""
    try:
        read_ckpt_contents(step_path)
        verify_manifest(step_path, required=False, checksums=False)
    except (CheckpointError, FileNotFoundError):
        return False
    return True


def find_resume_checkpoint(root: str, role: str = "actor", checksums: bool = True) -> tuple[str | None, list[str]]:
    """The step directory (``.../global_step_N/<role>``) a ``resume_mode=auto`` run loads, verified
    (``verify_checkpoint``; ``checksums`` as there), and notes (``tracked_step``)."""
    path, notes = tracked_step(root, role)
    if path is not None:
        verify_checkpoint(path, checksums=checksums)
    return path, notes


def tracked_step(root: str, role: str = "actor") -> tuple[str | None, list[str]]:
    """The step directory (``.../global_step_N/<role>``) the tracker names, not yet verified, and notes.

    A tracker that names a missing step is an error (nothing is deleted); incomplete staging directories and
    committed steps newer than the tracker are reported in the notes and skipped. No tracker: no resume.
    """
    notes = []
    for step, step_dir in list_step_dirs(root):
        staging = os.path.join(step_dir, role + STAGING_SUFFIX)
        if os.path.isdir(staging):
            notes.append(f"skipping {staging}: an interrupted save of step {step}")
    tracker = get_checkpoint_tracker_filename(root)
    tracked = read_tracker(root)
    if tracked is None:
        return None, notes
    path = os.path.join(root, STEP_DIR_FORMAT.format(tracked), role)
    if not os.path.isdir(path):
        superseded = superseded_path(path)
        if os.path.isdir(superseded):  # a re-save of the step stopped between its two renames (the driver puts it back)
            raise CheckpointError(f"checkpoint tracker {tracker} names step {tracked}, but {path} does not exist; its committed copy is {superseded} (a re-save stopped between its renames): rename it to {path}")
        raise CheckpointError(
            f"checkpoint tracker {tracker} names step {tracked}, but {path} does not exist; restore it, or set "
            "trainer.resume_mode=disable or trainer.resume_from_path=<a complete step>"
        )
    for step, step_dir in list_step_dirs(root):
        if step > tracked and is_complete(os.path.join(step_dir, role)):
            notes.append(f"skipping step {step}: committed but never tracked (the run stopped before the tracker was written)")
    return path, notes


def holds_hf_weights(contents: dict) -> bool:
    """Whether a step's ckpt_contents.json says its model or HF export lies in model/huggingface."""
    return any(contents.get("contents", {}).get(name, {}).get("format") == "huggingface" for name in ("model", "hf_model"))


def verify_checkpoint(step_path: str, transformer_config=None, hf_config=None, checksums: bool = True, bulk_checksums: bool = True) -> dict:
    """Everything a load checks before touching a tensor; returns the step's contents.

    Raises CheckpointError (or FileNotFoundError) naming the file and the cause (``UntrustedContentError`` for
    a dist-checkpoint file that holds anything but data). A step without our
    manifest (saved by upstream verl) gets a warning and the checks its own files allow. ``checksums=False``
    skips re-reading every file for its checksum, for a caller that has just done so (or just computed them);
    ``bulk_checksums=False`` leaves the shards' and weights' checksums to the load that reads them.
    """
    contents = read_ckpt_contents(step_path)
    if not verify_manifest(step_path, required=False, checksums=checksums, bulk_checksums=bulk_checksums):
        warnings.warn(f"{step_path} has no {MANIFEST_FILENAME}: a checkpoint saved by upstream verl (or in place by its API); its file sizes cannot be checked", stacklevel=2)
    from verl.utils.checkpoint.data_only import check_step

    check_step(step_path)  # every .metadata and bytes item is data: a crafted one is refused before any rank starts
    check_hf_folders_name_no_code(step_path, contents)
    if transformer_config is not None:
        check_model_identity(step_path, transformer_config)
    if holds_hf_weights(contents):
        verify_step_hf_export(step_path, hf_config)
    return contents


def check_hf_folders_name_no_code(step_path: str, contents: dict) -> None:
    """Every HF folder of the step (``model/huggingface`` and any the contents file points at) names no custom
    code: a checkpoint's code never runs (``verl.utils.custom_code``), whatever ``auto_map`` says."""
    from verl.utils.checkpoint.data_only import UntrustedContentError
    from verl.utils.custom_code import CustomCodeError, refuse_custom_code

    entries = contents.get("contents", {})
    folders = {hf_path(step_path)} | {
        os.path.join(step_path, entry["path"])
        for name, entry in entries.items()
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and (entry.get("format") == "huggingface" or name == "hf_config")
    }
    for folder in sorted(folders):
        try:
            refuse_custom_code(folder, f"checkpoint {step_path}", "a step this package saved names none; use a step whose HF folders name no custom code")
        except CustomCodeError as exc:
            raise UntrustedContentError(str(exc)) from None


def verify_step_hf_export(step_path: str, hf_config=None) -> int:
    """The step's HF export (``model/huggingface``) holds every tensor its config implies, with the expected
    shapes; returns how many. Raises CheckpointError naming what is missing or wrong. Where the manifest's
    record proves these very tensors complete for this config, the expectation is not derived again."""
    from verl.utils.checkpoint.hf_verify import verify_hf_checkpoint

    report = verify_hf_checkpoint(hf_path(step_path), hf_config, proof=(read_manifest(step_path) or {}).get(HF_EXPORT_KEY))
    if not report.ok:
        raise CheckpointError(report.describe())
    return report.expected
