"""Check that an HF checkpoint folder holds every tensor its config implies, with the right shapes.

The expectation comes from the config alone (the transformers model built on the meta device),
never from the bridge that wrote the weights: a bridge that silently drops tensors (verl #6821:
MoE experts of the last layers) cannot also vouch for its own output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from glob import glob

import torch
import transformers

from verl.utils.checkpoint import check_audit
from verl.utils.checkpoint.errors import CheckpointError
from verl.utils.checkpoint.names import INDEX_FILENAME
from verl.utils.custom_code import CustomCodeError, load_config
from verl.utils.internals import transformers as transformers_internals


class HFCheckpointIncompleteError(CheckpointError):
    """The HF folder is missing tensors, has unexpected ones, or has tensors of the wrong shape: a damaged
    checkpoint like any other, so every ``except CheckpointError`` (the rank's discard, the verifier) takes it."""


@dataclasses.dataclass
class HFVerifyReport:
    path: str
    expected: int
    found: int
    missing: list[str]
    unexpected: list[str]
    wrong_shape: list[str]
    index_problems: list[str]
    proof: dict | None = None  # where ``ok``: what a manifest records of it (``export_proof``)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape or self.index_problems)

    def describe(self, limit: int = 200) -> str:
        if self.ok:
            return f"{self.path}: all {self.expected} tensors present with the expected shapes"
        parts = [f"HF checkpoint {self.path} is incomplete ({self.found} of {self.expected} expected tensors found):"]
        for label, names in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("wrong shape", self.wrong_shape),
            ("index", self.index_problems),
        ):
            if names:
                shown = ", ".join(names[:limit]) + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")
                parts.append(f"  {label} ({len(names)}): {shown}")
        return "\n".join(parts)


_EXPECTED: dict[str, dict[str, tuple[int, ...]]] = {}  # a config's JSON -> its tensors (``expected_hf_tensors``)
_EXPECTED_KEPT = 4  # configs remembered: a trainer verifies one config at every save


def expected_hf_tensors(hf_config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors ``save_pretrained`` would write for this config.

    transformers 5 fuses MoE experts in memory (``experts.gate_up_proj`` [E, 2I, H]) but writes one tensor per
    expert, as 4.x and the bridge do: the model's own save-time conversion, applied here to the meta state,
    gives the names the files hold, still from the config alone. Built once per config (keyed by its whole
    JSON, so a changed config is built again): a meta model costs far more than reading the files' headers.
    """
    key = hf_config.to_json_string(use_diff=False)
    if key in _EXPECTED:
        return dict(_EXPECTED[key])
    from transformers import AutoModelForCausalLM

    # Weight initialisation on the meta device computes nothing but still walks every module: ~90% of
    # the time for a MoE with hundreds of experts. Shapes do not depend on it.
    with torch.device("meta"), transformers_internals.no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config)
    state = model.state_dict()
    if getattr(hf_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    if len(_EXPECTED) >= _EXPECTED_KEPT:
        _EXPECTED.pop(next(iter(_EXPECTED)))
    _EXPECTED[key] = {name: tuple(t.shape) for name, t in transformers_internals.as_saved(model, state).items()}
    return dict(_EXPECTED[key])


# Part of every proof: raised whenever how this package derives the expected tensors changes (``expected_hf_tensors``,
# ``transformers_internals.as_saved``), so that a step proven by the older derivation is judged again.
EXPECTATION_VERSION = 1


def export_proof(hf_config, found: dict[str, tuple[int, ...]]) -> dict[str, str | int]:
    """What a step's manifest records of an HF export found complete: the config it was checked against (its
    settings, with the transformers and the ``EXPECTATION_VERSION`` that derived the names) and the tensors found
    (names and shapes), each by SHA-256, and their count. A later check of the export against the same config
    compares the files' headers with this record instead of deriving the expected tensors again (only a record
    equal to this one proves anything): same config, same derivation, same tensors, the same complete export."""
    return {"config_sha256": _config_digest(hf_config), "tensors_sha256": _tensors_digest(found), "tensors": len(found)}


def _config_digest(hf_config) -> str:
    """The config's settings, not where it was read from (``_name_or_path``): the save's config and a resume's
    are read from different folders."""
    settings = {key: value for key, value in hf_config.to_dict().items() if key != "_name_or_path"}
    text = f"expectation {EXPECTATION_VERSION}; transformers {transformers.__version__}\n" + json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _tensors_digest(found: dict[str, tuple[int, ...]]) -> str:
    text = json.dumps(sorted((name, list(shape)) for name, shape in found.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on a header's length
_U64 = 2**64  # the format's dims and offsets are unsigned 64-bit
# bits per element of every dtype the safetensors format names; a name outside it is refused, as its reader does
_DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8}
_DTYPE_BITS |= {"I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


def _refuse_constant(name: str) -> None:
    raise ValueError(f"its header holds {name}, which JSON does not allow")


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64


def _tensor_bytes(name: str, shape: list[int], dtype: str) -> int:
    """The bytes ``shape`` elements of ``dtype`` take; refused before any product can outgrow 64 bits."""
    bits = _DTYPE_BITS[dtype]
    for dim in shape:
        if dim == 0:
            return 0
        bits *= dim
        if bits >= _U64 * 8:
            raise ValueError(f"tensor {name!r} of shape {shape} needs more bytes than a file can hold")
    if bits % 8:
        raise ValueError(f"tensor {name!r} of shape {shape} of {dtype} does not fill whole bytes")
    return bits // 8


def safetensors_shapes(file: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a safetensors file, from its header alone (8 bytes of length, then JSON), checked
    as the format's own reader checks a file it opens: known dtypes, unsigned 64-bit dims and offsets, byte ranges
    that tile the data section exactly, each as long as its shape and dtype say, and a file that ends where the
    data does. ``ValueError`` naming what is wrong. ``safe_open`` gives the same answer but maps the file, which
    from a cold page cache costs far more than this read (docs/perf.md)."""
    with open(file, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, shorter than a header")
        length = int.from_bytes(prefix, "little")
        if length > _HEADER_LIMIT:
            raise ValueError(f"its header claims {length} bytes, more than the format allows ({_HEADER_LIMIT})")
        if length > size - 8:
            raise ValueError(f"its header claims {length} bytes, the file holds {size - 8} after the length")
        header = json.loads(handle.read(length).decode("utf-8"), parse_constant=_refuse_constant)
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError("its __metadata__ is not a map of strings to strings")
    shapes, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape, dtype, offsets = (entry.get(k) if isinstance(entry, dict) else None for k in ("shape", "dtype", "data_offsets"))
        if not (isinstance(shape, list) and all(_is_u64(d) for d in shape) and isinstance(dtype, str)):
            raise ValueError(f"tensor {name!r} has no valid shape and dtype")
        if dtype not in _DTYPE_BITS:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which the safetensors format does not name")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name!r} has no valid data_offsets")
        needed = _tensor_bytes(name, shape, dtype)
        if offsets[1] - offsets[0] != needed:
            raise ValueError(f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, its shape {shape} of {dtype} needs {needed}")
        shapes[name] = tuple(shape)
        ranges.append(offsets)
    end = 0
    for begin, stop in sorted(ranges):
        if begin != end:
            raise ValueError(f"its tensors' byte ranges {'overlap' if begin < end else 'leave a gap'} at byte {min(begin, end)}")
        end = stop
    if end != size - 8 - length:
        raise ValueError(f"its tensors end at data byte {end}, the data section holds {size - 8 - length} (truncated?)")
    return shapes


def read_saved_tensors(path: str) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Shapes of every tensor in the folder's safetensors files (headers only), and index problems."""
    shapes: dict[str, tuple[int, ...]] = {}
    problems: list[str] = []
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    file_of: dict[str, str] = {}
    for file in files:
        try:
            found = safetensors_shapes(file)
        except (OSError, ValueError, RecursionError) as exc:  # a truncated or corrupt shard (JSON errors are ValueErrors)
            problems.append(f"{os.path.basename(file)} is unreadable ({exc})")
            continue
        shapes.update(found)
        file_of.update(dict.fromkeys(found, os.path.basename(file)))
    index_file = os.path.join(path, INDEX_FILENAME)
    if os.path.exists(index_file):
        with open(index_file) as handle:
            weight_map = json.load(handle).get("weight_map", {})
        on_disk = {os.path.basename(f) for f in files}
        problems.extend(f"index names {file}, which does not exist" for file in sorted(set(weight_map.values()) - on_disk))
        for name, file in sorted(weight_map.items()):
            if name in file_of and file_of[name] != file:
                problems.append(f"index maps {name} to {file}, but it is in {file_of[name]}")
        problems.extend(f"{name} is in {file_of[name]} but not in the index" for name in sorted(set(file_of) - set(weight_map)))
    return shapes, problems


def verify_hf_checkpoint(path: str, hf_config=None, proof: object = None) -> HFVerifyReport:
    """Compare the folder's tensors with what its config (or ``hf_config``) implies. ``proof``: the record of an
    earlier check (``export_proof``, from the step's manifest); where it proves the folder's tensors complete for
    this config, the expectation is not derived again."""
    check_audit.note(check_audit.HF_EXPORT, os.path.abspath(path))
    if hf_config is None:
        try:
            hf_config = load_config(path, f"HF folder {path}", fix="an HF folder this package wrote names no custom code; use one that does not")
        except CustomCodeError as exc:
            raise CheckpointError(str(exc)) from None
    found, index_problems = read_saved_tensors(path)
    mine = export_proof(hf_config, found)
    if not index_problems and proof == mine:  # a manifest's record is untrusted data: anything else proves nothing
        return HFVerifyReport(
            path=path, expected=len(found), found=len(found), missing=[], unexpected=[], wrong_shape=[], index_problems=[], proof=mine
        )
    expected = expected_hf_tensors(hf_config)
    report = HFVerifyReport(
        path=path,
        expected=len(expected),
        found=len(set(found) & set(expected)),
        missing=sorted(set(expected) - set(found)),
        unexpected=sorted(set(found) - set(expected)),
        wrong_shape=sorted(f"{n} {found[n]} != {expected[n]}" for n in set(found) & set(expected) if found[n] != expected[n]),
        index_problems=index_problems,
    )
    if report.ok:
        report.proof = mine
    return report
