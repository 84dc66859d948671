"""Tests for bench.discovery: the newest-complete benchmark still runs and measures what it says."""
from __future__ import annotations

from bench.discovery import run_large


class TestDiscoveryBenchmark:
    def test_run_large_reports_every_key(self):
        """run_large() (here on a tiny model, 2 ranks) reports cold discovery ms, parse CPU, peak RSS, torch ratio."""
        r = run_large(model="tiny", ranks=(2,), repeats=1, torch_ranks=2)
        assert set(r["discovery_ms"]) == {"llamatiny_r2", "llama_note"} and r["discovery_ms"]["llamatiny_r2"] > 0
        assert r["parse_vs_torch_ratio"] > 0 and r["metadata_parse"]["linearity"] == 1.0
        p = r["metadata_parse"]["llamatiny_r2"]
        assert p["metadata_mb"] >= 0 and p["parse_cpu_s"] >= 0 and p["peak_rss_x"] >= 0 and p["chunks"] > 0
        assert set(p["versus_torch"]) == {"ours_cpu", "torch_cpu", "ours_wall", "torch_wall"}
