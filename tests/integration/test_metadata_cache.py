"""Tests for supervisor.checkpoints.metadata.cache: parsed `.metadata` summaries shared across processes."""
from __future__ import annotations

import os

from supervisor.checkpoints.testing import write_checkpoint
from tests.supervise import cli
from tests.unit.test_metadata_cache import (
    aged,
    cache,  # noqa: F401  (a fixture, taken as an argument)
    entries,
)


class TestSharedAcrossProcesses:
    def test_a_second_process_takes_the_verdict_from_the_cache(self, tmp_path, cache):
        """After one `checkpoints verify`, another answers from the cache: it calls a same-identity garbage file complete."""
        ckpt = write_checkpoint(tmp_path / "root", 10, shards=2, manifest=False)
        path = aged(ckpt)
        first = cli("checkpoints", "verify", str(ckpt))
        assert first.returncode == 0 and ": complete" in first.stdout, first.stderr
        assert len(entries(cache)) == 1
        # Same inode, size and mtime, other bytes: only a reader that skips parsing can still say complete.
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(b"\x00" * st.st_size)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = path.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        second = cli("checkpoints", "verify", str(ckpt))
        assert second.returncode == 0 and ": complete" in second.stdout, second.stdout + second.stderr
        # Control: a new mtime is a new identity, so the garbage is parsed and found.
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        third = cli("checkpoints", "verify", str(ckpt))
        assert third.returncode == 1 and "bad .metadata" in third.stdout

    def test_shards_are_still_checked_on_a_cache_hit(self, tmp_path, cache):
        """A cached summary only replaces parsing: a shard deleted since is still found missing."""
        ckpt = write_checkpoint(tmp_path / "root", 10, shards=2, manifest=False)
        aged(ckpt)
        assert cli("checkpoints", "verify", str(ckpt)).returncode == 0
        (ckpt / "__1_0.distcp").unlink()
        r = cli("checkpoints", "verify", str(ckpt))
        assert r.returncode == 1 and "torn" in r.stdout and "__1_0.distcp is missing" in r.stdout
