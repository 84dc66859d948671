"""Tests for supervisor.checkpoints.metadata.cache: parsed `.metadata` summaries shared across processes."""
from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest

from supervisor.checkpoints.metadata import cache as metadata_cache
from supervisor.checkpoints.metadata import reader as md
from tests.jobs.dcp_files import write_checkpoint

HOUR_NS = 3600 * 10**9


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache dir for this test, and empty in-process state. A file's ctime cannot be set back, so the
    racy window is closed here (RACY_NS 0: every file written before the read is old enough); the tests of that
    window open it again."""
    d = tmp_path / "cache"
    monkeypatch.setenv(metadata_cache.CACHE_ENV, str(d))
    monkeypatch.setattr(md, "RACY_NS", 0)
    md._cache.clear()
    md.COUNTS.clear()
    yield d / "metadata-v1"
    md._cache.clear()


def aged(directory: Path) -> Path:
    """Backdate `.metadata` by an hour: a file this old has a trustworthy identity (not racy)."""
    path = directory / ".metadata"
    then = time.time_ns() - HOUR_NS
    os.utime(path, ns=(then, then))
    return path


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json")) if cache.exists() else []


class TestInProcess:
    def test_memory_then_disk_then_parse(self, tmp_path, cache):
        """The first read parses, the second comes from memory, a fresh process state from disk."""
        path = aged(write_checkpoint(tmp_path / "root", 1, shards=3, manifest=False))
        first = md.read_metadata(path)
        assert md.read_metadata(path) == first
        md._cache.clear()
        assert md.read_metadata(path) == first
        assert md.COUNTS == {"parsed": 1, "memory": 1, "disk": 1}

    def test_refusals_are_cached_with_their_kind(self, tmp_path, cache):
        """An unsafe file's refusal is remembered too, and comes back as the same exception type and message."""
        d = write_checkpoint(tmp_path / "root", 1, shards=1, manifest=False)
        (d / ".metadata").write_bytes(pickle.dumps(print))
        path = aged(d)
        with pytest.raises(md.UnsafeMetadataError) as first:
            md.read_metadata(path)
        md._cache.clear()
        with pytest.raises(md.UnsafeMetadataError) as second:
            md.read_metadata(path)
        assert str(first.value) == str(second.value) == "refuses builtins.print (could run code)"
        assert md.COUNTS == {"parsed": 1, "disk": 1}

    def test_a_fresh_file_is_not_remembered(self, tmp_path, cache, monkeypatch):
        """A `.metadata` modified moments ago is parsed but not cached: a same-tick rewrite could keep its identity."""
        monkeypatch.setattr(md, "RACY_NS", 2 * 10**9)
        path = write_checkpoint(tmp_path / "root", 1, manifest=False) / ".metadata"
        md.read_metadata(path)
        md.read_metadata(path)
        assert md.COUNTS == {"parsed": 2} and entries(cache) == []

    def test_a_file_changed_moments_ago_is_not_remembered_even_with_an_old_mtime(self, tmp_path, cache, monkeypatch):
        """Its mtime put back an hour, its ctime is now: a second same-tick rewrite could keep that ctime too."""
        monkeypatch.setattr(md, "RACY_NS", 2 * 10**9)
        path = aged(write_checkpoint(tmp_path / "root", 1, manifest=False))
        md.read_metadata(path)
        md.read_metadata(path)
        assert md.COUNTS == {"parsed": 2} and entries(cache) == []


class TestStaleVerdicts:
    """A remembered verdict never outlives the file it describes, nor the reader that judged it."""

    @pytest.mark.parametrize("remembered_by", ["this process", "the disk cache"])
    def test_a_same_size_rewrite_with_its_mtime_put_back_is_judged_again(self, tmp_path, cache, remembered_by):
        """`.metadata` rewritten to name a shard that is not there, same size, its mtime restored (a restore, `cp -p`,
        `rsync -t`): only the ctime tells; a remembered `complete` would hide the torn checkpoint."""
        from supervisor.checkpoints import verify

        d = write_checkpoint(tmp_path / "root", 1, shards=2, manifest=False)
        path = aged(d)
        assert verify(d).complete and len(entries(cache)) == 1
        if remembered_by == "the disk cache":
            md._cache.clear()
        st = path.stat()
        path.write_bytes(path.read_bytes().replace(b"__1_0.distcp", b"__9_0.distcp"))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        now = path.stat()
        assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        v = verify(d)
        assert v.state == "torn" and "__9_0.distcp" in (v.reason or ""), v

    def test_an_upgrade_forgets_the_verdicts_of_the_reader_before(self, tmp_path, cache, monkeypatch):
        """An older reader cached "unknown class" for this very file; this reader knows better and parses it again."""
        path = aged(write_checkpoint(tmp_path / "root", 1, manifest=False))
        unknown = {"kind": "unknown_class", "message": "unknown class torch.NewThing in .metadata (written by a newer "
                   "torch?)", "global": "torch.NewThing"}
        with monkeypatch.context() as older:
            older.setattr(metadata_cache, "reader_version", lambda: "0.0.9+an-older-reader", raising=False)
            metadata_cache.store(path, path.stat(), {"error": unknown})
        assert len(entries(cache)) == 1
        assert md.read_metadata(path).entries == 3 and md.COUNTS == {"parsed": 1}

    def test_the_reader_version_follows_its_source(self):
        """The version names this package's version and a digest of the reader's source files."""
        from supervisor import __version__

        version = metadata_cache.reader_version()
        assert version.startswith(__version__ + "+") and len(version) == len(__version__) + 17

    def test_fresh_ignores_what_is_remembered_and_replaces_it(self, tmp_path, cache):
        """Within fresh() (verify --no-cache) a poisoned entry is not used, and the fresh result takes its place."""
        path = aged(write_checkpoint(tmp_path / "root", 1, manifest=False))
        unknown = {"kind": "unknown_class", "message": "unknown class torch.NewThing", "global": "torch.NewThing"}
        metadata_cache.store(path, path.stat(), {"error": unknown})
        with pytest.raises(md.UnknownClassError):
            md.read_metadata(path)
        with md.fresh():
            assert md.read_metadata(path).entries == 3
        md._cache.clear()
        assert md.read_metadata(path).entries == 3 and md.COUNTS == {"disk": 2, "parsed": 1}


class TestMisses:
    def _one_entry(self, tmp_path: Path, cache: Path) -> tuple[Path, Path]:
        path = aged(write_checkpoint(tmp_path / "root", 1, shards=2, manifest=False))
        md.read_metadata(path)
        md._cache.clear()
        (entry,) = entries(cache)
        return path, entry

    @pytest.mark.parametrize("corrupt", [
        lambda e: b"not json",
        lambda e: b"[]",
        lambda e: json.dumps({**e, "format": 2}).encode(),
        lambda e: json.dumps({**e, "key": {**e["key"], "ino": 1}}).encode(),
        lambda e: json.dumps({**e, "summary": {**e["summary"], "storage": [["__0_0.distcp", -1, 1]]}}).encode(),
        lambda e: json.dumps({**e, "summary": {**e["summary"], "entries": "2"}}).encode(),
        lambda e: json.dumps({**e, "extra": 1}).encode(),
        lambda e: json.dumps({k: v for k, v in e.items() if k != "summary"} | {"error": {"kind": "x"}}).encode(),
        lambda e: b"[" * 100_000,
    ])
    def test_malformed_entry_is_a_silent_miss(self, tmp_path, cache, corrupt):
        """A garbled, foreign or wrongly typed entry is ignored: the file is parsed again, nothing raises."""
        path, entry = self._one_entry(tmp_path, cache)
        good = md.read_metadata(path)
        md._cache.clear()
        md.COUNTS.clear()
        entry.write_bytes(corrupt(json.loads(entry.read_text())))
        assert md.read_metadata(path) == good
        assert md.COUNTS == {"parsed": 1}

    def test_symlinked_entry_is_not_followed(self, tmp_path, cache):
        """An entry replaced by a symlink (to a valid-looking file) is a miss."""
        path, entry = self._one_entry(tmp_path, cache)
        (tmp_path / "elsewhere.json").write_bytes(entry.read_bytes())
        entry.unlink()
        entry.symlink_to(tmp_path / "elsewhere.json")
        md.read_metadata(path)
        assert md.COUNTS["parsed"] == 2

    def test_cache_writable_by_others_is_not_used(self, tmp_path, cache):
        """A cache dir others may write to could be poisoned: it is neither read nor written."""
        path, entry = self._one_entry(tmp_path, cache)
        cache.chmod(0o777)
        try:
            md.read_metadata(path)
            assert md.COUNTS["parsed"] == 2 and md.COUNTS["disk"] == 0
        finally:
            cache.chmod(0o700)

    def test_unusable_cache_location_is_a_silent_miss(self, tmp_path, monkeypatch):
        """A cache path under a regular file (so no dir can be made) just means no cache."""
        (tmp_path / "file").write_text("")
        monkeypatch.setenv(metadata_cache.CACHE_ENV, str(tmp_path / "file" / "cache"))
        md._cache.clear()
        path = aged(write_checkpoint(tmp_path / "root", 1, manifest=False))
        assert md.read_metadata(path).entries == 3

    def test_cache_inside_the_checkpoint_root_is_never_used(self, tmp_path, monkeypatch):
        """A cache dir configured under the checkpoint root is not written (it would show up as a foreign dir)."""
        root = tmp_path / "root"
        monkeypatch.setenv(metadata_cache.CACHE_ENV, str(root / ".cache"))
        md._cache.clear()
        md.read_metadata(aged(write_checkpoint(root, 1, manifest=False)))
        assert not (root / ".cache").exists()


    def test_cache_inside_the_root_is_never_used_for_a_nested_checkpoint(self, tmp_path, monkeypatch):
        """Nor when the `.metadata` sits a level deeper, in an Accelerate `checkpoint_N/<member>/`."""
        from supervisor.checkpoints import verify

        root = tmp_path / "root"
        monkeypatch.setenv(metadata_cache.CACHE_ENV, str(root / "cache"))
        md._cache.clear()
        for member in ("pytorch_model_fsdp_0", "optimizer_0"):
            aged(write_checkpoint(root / "checkpoint_0", 0, name=member, manifest=False))
        assert verify(root / "checkpoint_0").complete
        assert sorted(os.listdir(root)) == ["checkpoint_0"]


class TestLocationAndBounds:
    def test_location_follows_the_environment(self, monkeypatch, tmp_path):
        """$FSDP_SUPERVISOR_CACHE_DIR, else $XDG_CACHE_HOME/fsdp-supervisor, else ~/.cache/fsdp-supervisor."""
        monkeypatch.setenv(metadata_cache.CACHE_ENV, str(tmp_path / "a"))
        assert metadata_cache.cache_dir() == tmp_path / "a"
        monkeypatch.delenv(metadata_cache.CACHE_ENV)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert metadata_cache.cache_dir() == tmp_path / "xdg" / "fsdp-supervisor"
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert metadata_cache.cache_dir() == tmp_path / "home" / ".cache" / "fsdp-supervisor"

    def test_the_test_session_never_uses_the_real_home(self):
        """conftest points the cache at a per-session tmp dir, inherited by every subprocess the tests start."""
        configured = Path(os.environ[metadata_cache.CACHE_ENV])
        assert "fsdp-supervisor-cache" in configured.name and not str(configured).startswith(str(Path.home() / ".cache"))

    def test_entries_are_bounded(self, tmp_path, cache, monkeypatch):
        """Past MAX_BYTES of entries on disk the oldest are removed until 3/4 remain."""
        md.read_metadata(aged(write_checkpoint(tmp_path / "root", 1, manifest=False)))
        size = entries(cache)[0].stat().st_size
        monkeypatch.setattr(metadata_cache, "MAX_BYTES", 8 * size)
        monkeypatch.setattr(metadata_cache, "_EVICT_EVERY", 1)
        for step in range(2, 21):
            md.read_metadata(aged(write_checkpoint(tmp_path / "root", step, manifest=False)))
        assert 0 < sum(p.stat().st_size for p in entries(cache)) <= 8 * size
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in entries(cache))


class TestMemory:
    def test_bounded_by_bytes_oldest_first(self):
        """The process's results are kept up to the cap in (estimated) bytes: past it the oldest go, 3/4 remain."""
        mem = metadata_cache.Memory(1000)
        for i in range(30):
            mem.put(("/r/step_%d/.metadata" % i,), i, 100)
        assert sum(n for _, n in mem.values()) <= 1000 and [v for v, _ in mem.values()][-1] == 29
        assert metadata_cache.oldest_over([("a", 600), ("b", 300), ("c", 200)], 1000) == ["a"]
        assert metadata_cache.oldest_over([("a", 600), ("b", 300)], 1000) == []

    def test_results_of_deleted_checkpoints_are_forgotten(self, tmp_path, cache):
        """A checkpoint deleted (by retention or by hand): its parsed `.metadata` leaves the process at the next pass."""
        kept, doomed = (write_checkpoint(tmp_path / "root", s, manifest=False) for s in (1, 2))
        for d in (kept, doomed):
            md.read_metadata(aged(d))
        assert {k[0] for k in md._cache} >= {str(kept / ".metadata"), str(doomed / ".metadata")}
        import shutil
        shutil.rmtree(doomed)
        metadata_cache.MEMORY.forget_gone()
        known = {k[0] for k in md._cache}
        assert str(kept / ".metadata") in known and str(doomed / ".metadata") not in known

    def test_the_estimate_holds(self):
        """PARSED_FACTOR x a summary's JSON bytes is at least what the parsed result holds (256 ranks' shards)."""
        import sys
        import tracemalloc
        refs = [["__%d_0.distcp" % r, 10_000_000 + r, 40] for r in range(256)]
        entry = {"summary": {"version": "2.4", "entries": 2000, "storage": refs}}
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        parsed = md._summary(json.loads(json.dumps(entry))["summary"])
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert held <= metadata_cache.PARSED_FACTOR * len(str(entry)), (held, len(str(entry)))
        assert len(parsed.storage) == 256 and sys.getsizeof(parsed) > 0
