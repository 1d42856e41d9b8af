"""The split of a step's files over the ranks for hashing, and the background hashing itself."""

from __future__ import annotations

import os
import zlib

from verl.utils.checkpoint.integrity import build_manifest
from verl.utils.checkpoint.save_writers import Sealer, share_of


def test_every_file_goes_to_exactly_one_rank_and_the_bytes_are_balanced():
    relpaths = [f"optimizer/dist_ckpt/__{i}_0.distcp" for i in range(9)]
    sizes = [900, 100, 800, 200, 700, 300, 600, 400, 500]
    shares = [share_of(relpaths, sizes, rank, 3) for rank in range(3)]
    assert sorted(p for share in shares for p in share) == sorted(relpaths)
    by_path = dict(zip(relpaths, sizes, strict=True))
    loads = [sum(by_path[p] for p in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes) // 4, loads
    assert share_of(relpaths, sizes, 0, 1) == sorted(relpaths, key=by_path.get, reverse=True)


def test_sealed_checksums_are_the_files_and_an_unreadable_file_is_left_to_the_commit(tmp_path):
    data = {"a.bin": os.urandom(3 << 20), "b.bin": b"", "c.bin": b"xyz"}
    for name, payload in data.items():
        (tmp_path / name).write_bytes(payload)
    sealer = Sealer(str(tmp_path))
    sealer.seal(["a.bin", "b.bin", "gone.bin"])
    sealed = sealer.results()
    assert sealed == {"a.bin": f"crc32:{zlib.crc32(data['a.bin']):08x}", "b.bin": "crc32:00000000"}
    manifest = build_manifest(str(tmp_path), known_checksums=sealed)
    assert {name: entry["checksum"] for name, entry in manifest["files"].items()} == {
        name: f"crc32:{zlib.crc32(payload):08x}" for name, payload in data.items()
    }


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
