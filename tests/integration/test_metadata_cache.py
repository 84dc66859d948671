"""Tests for supervisor.checkpoints.metadata.cache: parsed `.metadata` summaries shared across processes."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from supervisor.checkpoints.metadata.reader import RACY_NS
from tests.jobs.dcp_files import write_checkpoint
from tests.supervise import cli
from tests.unit.test_metadata_cache import (
    aged,
    cache,  # noqa: F401  (a fixture, taken as an argument)
    entries,
)


def settled(path: Path) -> Path:
    """Wait until `path` changed longer ago than RACY_NS: only then does a reader in another process remember it."""
    left = RACY_NS - (time.time_ns() - max(path.stat().st_mtime_ns, path.stat().st_ctime_ns))
    time.sleep(max(0, left) / 1e9 + 0.05)
    return path


class TestSharedAcrossProcesses:
    def test_a_second_process_takes_the_verdict_from_the_cache(self, tmp_path, cache):
        """After one `checkpoints verify`, another answers from the cache (here an entry we doctored says a shard
        must be larger than it is); a same-size rewrite of `.metadata` with its mtime put back is parsed again."""
        ckpt = write_checkpoint(tmp_path / "root", 10, shards=2, manifest=False)
        path = settled(aged(ckpt))
        first = cli("checkpoints", "verify", str(ckpt))
        assert first.returncode == 0 and ": complete" in first.stdout, first.stderr
        (entry,) = entries(cache)
        doctored = json.loads(entry.read_text())
        doctored["summary"]["storage"][0][1] = 10**12
        entry.write_text(json.dumps(doctored))
        second = cli("checkpoints", "verify", str(ckpt))
        assert second.returncode == 1 and "torn" in second.stdout, second.stdout + second.stderr
        # Same inode, size and mtime, other bytes: the ctime is new, so the file is parsed again and found bad.
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(b"\x00" * st.st_size)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = path.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        third = cli("checkpoints", "verify", str(ckpt))
        assert third.returncode == 1 and "bad .metadata" in third.stdout, third.stdout + third.stderr

    def test_shards_are_still_checked_on_a_cache_hit(self, tmp_path, cache):
        """A cached summary only replaces parsing: a shard deleted since is still found missing."""
        ckpt = write_checkpoint(tmp_path / "root", 10, shards=2, manifest=False)
        settled(aged(ckpt))
        assert cli("checkpoints", "verify", str(ckpt)).returncode == 0 and len(entries(cache)) == 1
        (ckpt / "__1_0.distcp").unlink()
        r = cli("checkpoints", "verify", str(ckpt))
        assert r.returncode == 1 and "torn" in r.stdout and "__1_0.distcp is missing" in r.stdout
