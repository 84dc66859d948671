"""Tests for bench.discovery: the newest-complete benchmark still runs and measures what it says."""
from __future__ import annotations

from bench.discovery import build_root, run
from supervisor.checkpoints import newest_complete, scan


class TestDiscoveryBenchmark:
    def test_built_root_is_all_complete_and_valid(self, tmp_path):
        """The synthetic root holds n complete checkpoints of the requested shard count."""
        build_root(tmp_path, 5, 16)
        infos = scan(tmp_path)
        assert [c.step for c in infos] == [500, 400, 300, 200, 100] and all(c.complete for c in infos)
        assert len(list(infos[0].path.glob("*.distcp"))) == 16
        assert newest_complete(tmp_path).step == 500

    def test_run_reports_medians_for_the_requested_size(self):
        """run() returns a median for nN and the other scenarios, all non-negative numbers."""
        result = run(n=12, shards=2, repeats=1)
        for key in ("n12", "n12_newest10_torn", "scan12_cached", "scan12_cold", "parse_ms_per_mb"):
            assert isinstance(result[key], float) and result[key] >= 0
