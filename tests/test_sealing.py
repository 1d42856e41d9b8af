"""Which files a rank seals (the ones it wrote), and the background hashing itself."""

from __future__ import annotations

import os
import zlib

import pytest

from verl.utils.checkpoint.durability import Sealer, own_files
from verl.utils.checkpoint.integrity import build_manifest


def test_a_rank_seals_what_its_writer_reported_and_rank_zero_what_a_writer_that_reports_none_wrote(tmp_path):
    folder = tmp_path / "huggingface"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.safetensors", "b.safetensors", "sub/c.json"):
        (folder / name).write_bytes(b"x")
    reported = [str(folder / "b.safetensors")]
    assert [own_files(str(folder), reported, rank) for rank in (0, 1)] == [reported, reported]
    everything = [str(folder / n) for n in ("a.safetensors", "b.safetensors", "sub/c.json")]
    assert [own_files(str(folder), None, rank) for rank in (0, 1)] == [everything, []]


def test_sealed_checksums_are_the_files_and_the_manifest_hashes_only_what_no_writer_sealed(tmp_path):
    data = {"a.bin": os.urandom(3 << 20), "b.bin": b"", "c.bin": b"xyz"}
    for name, payload in data.items():
        (tmp_path / name).write_bytes(payload)
    sealer = Sealer(str(tmp_path))
    sealer.seal(["a.bin", "b.bin"])
    sealed = sealer.results()
    assert sealed == {"a.bin": f"crc32:{zlib.crc32(data['a.bin']):08x}", "b.bin": "crc32:00000000"}
    manifest = build_manifest(str(tmp_path), known_checksums=sealed)
    assert {name: entry["checksum"] for name, entry in manifest["files"].items()} == {
        name: f"crc32:{zlib.crc32(payload):08x}" for name, payload in data.items()
    }


def test_a_reported_file_that_is_gone_fails_the_seal_naming_it(tmp_path):
    """A file the writer said it wrote and that is gone is part of the step lost: the commit must not go on."""
    (tmp_path / "a.bin").write_bytes(b"abc")
    sealer = Sealer(str(tmp_path))
    sealer.seal(["a.bin", "sub/gone.bin"])
    with pytest.raises(FileNotFoundError, match=r"sub/gone.bin was reported written by this rank's writer but is gone") as caught:
        sealer.results()
    assert caught.value.filename == str(tmp_path / "sub" / "gone.bin")


def test_an_fsync_that_fails_is_raised_naming_the_file_not_left_to_another_rank(tmp_path):
    """A failed fsync means pages the writer's host held may be lost: no other host's fsync can make up for it."""
    (tmp_path / "a.bin").write_bytes(b"xyz")
    sealer = Sealer(str(tmp_path))
    sealer.seal(["a.bin", os.devnull])  # fsync of a character device: EINVAL, a real failure of the call
    with pytest.raises(OSError, match=r"Invalid argument: '/dev/null'"):
        sealer.results()


def test_a_file_hashed_while_the_save_went_on_is_not_read_again(tmp_path):
    (tmp_path / "c.bin").write_bytes(b"xyz")
    manifest = build_manifest(str(tmp_path), known_checksums={"c.bin": "crc32:0badf00d"})
    assert manifest["files"]["c.bin"] == {"size": 3, "checksum": "crc32:0badf00d"}


_CHECKSUM_WITHOUT_ZLIB_NG = """
import sys
sys.modules["zlib_ng"] = None  # not installed
from verl.utils.checkpoint import integrity
print(integrity.crc32.__module__, integrity.file_checksum(sys.argv[1]))
"""


def test_the_checksum_is_zlibs_crc32_with_zlib_ng_and_without_it(tmp_path):
    """zlib-ng computes the manifest's CRC-32 where installed (requirements.txt), the standard zlib elsewhere:
    the same value either way, over files spanning several of the hash's chunks, so manifests cross over."""
    import subprocess
    import sys

    import verl
    from verl.utils.checkpoint import integrity

    payload = os.urandom(1 << 20) * 19 + b"tail"  # 19 MiB and a few bytes: three chunks, the last one short
    path = tmp_path / "big.bin"
    path.write_bytes(payload)
    expected = f"crc32:{zlib.crc32(payload):08x}"
    assert integrity.crc32.__module__.startswith("zlib_ng")
    assert integrity.file_checksum(str(path)) == expected
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(verl.__file__)), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _CHECKSUM_WITHOUT_ZLIB_NG, str(path)], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.split() == ["zlib", expected]
