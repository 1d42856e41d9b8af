"""The HF export check reads each safetensors file's header only, and refuses a damaged one as the format's reader would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from verl.utils.checkpoint.hf_verify import read_saved_tensors, safetensors_shapes


def _written(tmp_path) -> str:
    path = str(tmp_path / "model.safetensors")
    tensors = {"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.zeros(0, 2), "d": torch.zeros(2, dtype=torch.int64)}
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def _with_header(path: str, edit) -> None:
    """Rewrite the file with its header JSON changed by ``edit`` (the data section kept)."""
    raw = Path(path).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    Path(path).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def test_shapes_from_the_header_equal_safetensors_own(tmp_path):
    path = _written(tmp_path)
    with safe_open(path, framework="pt") as handle:
        expected = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert safetensors_shapes(path) == expected == {"a": (3, 4), "b": (5,), "c": (0, 2), "d": (2,)}


def _truncated(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 4)


def _header_longer_than_the_file(path: str) -> None:
    raw = Path(path).read_bytes()
    Path(path).write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])


def _overwrite_start(path: str, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.write(data)


def _shorter_than_a_length(path: str) -> None:
    Path(path).write_bytes(b"\x01\x02")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncated, r"the data section holds \d+ \(truncated\?\)"),
        (_header_longer_than_the_file, r"its header claims \d+ bytes, the file holds \d+"),
        (_shorter_than_a_length, r"2 bytes, shorter than a header"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape=[3, 5])), r"tensor 'a' spans 48 bytes, its shape \[3, 5\] of F32 needs 60"),
        (lambda p: _with_header(p, lambda h: h["b"].update(data_offsets=[0, 10])), r"byte ranges overlap at byte 0"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape="3x4")), r"tensor 'a' has no valid shape and dtype"),
        (lambda p: _with_header(p, lambda h: h["d"].update(data_offsets=[1])), r"tensor 'd' has no valid data_offsets"),
        (lambda p: _overwrite_start(p, (3).to_bytes(8, "little") + b"[1]"), r"its header is not a JSON object"),
        (lambda p: _overwrite_start(p, (100_000_001).to_bytes(8, "little")), r"its header claims 100000001 bytes, more than the format allows"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape=[True, 12])), r"tensor 'a' has no valid shape and dtype"),
        (lambda p: _with_header(p, lambda h: h["a"].update(dtype="F12")), r"tensor 'a' has dtype 'F12', which the safetensors format does not name"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape=[2**63, 2**63])), r"tensor 'a' of shape .* needs more bytes than a file can hold"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape=[2**64])), r"tensor 'a' has no valid shape and dtype"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape=[3], dtype="F4")), r"tensor 'a' of shape \[3\] of F4 does not fill whole bytes"),
        (lambda p: _with_header(p, lambda h: h["a"].update(data_offsets=[-48, 0])), r"tensor 'a' has no valid data_offsets"),
        (lambda p: _with_header(p, lambda h: h.update(__metadata__={"format": 1})), r"its __metadata__ is not a map of strings to strings"),
        (lambda p: _with_header(p, lambda h: h["a"].update(shape=[float("nan")])), r"its header holds NaN, which JSON does not allow"),
    ],
    ids=[
        "truncated", "header-beyond-file", "tiny", "shape-vs-bytes", "overlap", "shape-not-list", "offsets-not-pair", "not-object",
        "header-beyond-limit", "bool-dim", "unknown-dtype", "overflowing-shape", "dim-beyond-u64", "sub-byte-remainder", "negative-offset", "metadata-not-strings", "nan",
    ],  # fmt: skip
)
def test_a_damaged_file_is_named_unreadable_with_its_reason(tmp_path, damage, reason):
    path = _written(tmp_path)
    damage(path)
    with pytest.raises(SafetensorError), safe_open(path, framework="pt"):  # the format's own reader refuses it too
        pass
    with pytest.raises(ValueError, match=reason):
        safetensors_shapes(path)
    shapes, problems = read_saved_tensors(str(tmp_path))
    assert shapes == {} and len(problems) == 1 and problems[0].startswith("model.safetensors is unreadable ("), problems


@pytest.mark.parametrize(
    ("edit", "shapes"),
    [
        (lambda h: h["d"].update(shape=[4, 8], dtype="F4"), {"d": (4, 8)}),  # 16 bytes of two int64s: 32 four-bit floats
        (lambda h: h.update(__metadata__=None), {"d": (2,)}),
    ],
    ids=["sub-byte-dtype", "null-metadata"],
)
def test_what_the_formats_reader_takes_is_read(tmp_path, edit, shapes):
    path = _written(tmp_path)
    _with_header(path, edit)
    with safe_open(path, framework="pt") as handle:
        assert set(handle.keys()) == {"a", "b", "c", "d"}
    assert safetensors_shapes(path).items() >= shapes.items()
