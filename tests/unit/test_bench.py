"""Smoke tests of the benchmarks (issues 7 and 12): each one runs at a tiny size and returns the documented keys.

Benchmarks report timings; these tests never judge a timing, only shapes, signs and the goal arithmetic.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import GOALS, evaluate, main, render
from bench.common import train_lines, trainer_argv
from bench.local_tier import K as LOCAL_K
from bench.save_stall import reduce


class TestGoals:
    def test_every_issue_key_is_gated(self) -> None:
        """The table gates the nine goals of issue 7, the three of the metadata reader, four of issue 12, three of
        issue 25, five of issue 26 (recovery at half of torchrun's restart, and the node-local tier), four of
        issue 34 (what checksums cost; the corruption campaign: every fault caught, none resumed) and four of issue 37
        (hang detection on by default, alerts, the soak)."""
        assert {k for k, _, _ in GOALS} == {
            "recovery_s.ratio", "save_stall_s.async_over_sync", "save_stall_s.async_over_memcpy", "write_gbps.ratio",
            "supervisor.rss_mb", "supervisor.idle_cpu_pct", "supervisor.import_s", "discovery_ms.n1000",
            "throughput_ratio", "parse_vs_torch_ratio", "metadata_parse.peak_rss_x", "metadata_parse.linearity",
            "load_gbps.ratio", "loop_stall_ms_max", "signal_latency_during_verify_s", "discovery_ms.llama70b_r64",
            "hang_recovery_s.beyond_timeout", "heartbeat.per_rank_overhead", "steps_lost.error",
            "recovery_s.breakdown.supervisor.worker_init", "local_tier.throughput_ratio",
            "local_tier.steps_lost_median", "local_tier.load_speedup", "integrity.write_overhead",
            "integrity.verify_ratio", "integrity.campaign.caught_pct", "integrity.campaign.resumed",
            "divergence.false_positives", "hang_recovery_s.auto_beyond_threshold", "hang.false_positives",
            "notify.latency_s", "soak.rss_growth_kb_per_100_attempts"}
        assert ("throughput_ratio", ">=", 0.99) in GOALS
        assert ("recovery_s.ratio", "<=", 0.5) in GOALS and ("local_tier.steps_lost_median", "<=", LOCAL_K) in GOALS

    def test_met_missed_and_missing(self) -> None:
        """<= and >= goals are judged on the value; an absent value is neither met nor missed."""
        got = evaluate({"recovery_s": {"ratio": 1.2}, "write_gbps": {"ratio": 0.9}, "throughput_ratio": 0.97})
        assert got["recovery_s.ratio"]["met"] is False and got["write_gbps.ratio"]["met"] is True
        assert got["throughput_ratio"]["met"] is False and got["supervisor.rss_mb"]["met"] is None
        table = render({"recovery_s": {"ratio": 1.2, "supervisor": 3.5}})
        assert "MISSED" in table and "n/a" in table and "recovery_s.supervisor" in table

    def test_steps_lost_errors_of_every_section_add_up(self) -> None:
        """recovery's and hangs' rounds each report reported - true; the gated figure is the largest miss."""
        from bench.__main__ import _merge

        results: dict = {}
        _merge(results, {"recovery_s": {"ratio": 1.0}, "steps_lost_errors": [0, 0]})
        _merge(results, {"hang_recovery_s": {"median": 9.0}, "steps_lost_errors": [-2, None]})
        assert results["steps_lost"] == {"errors": [0, 0, -2, None], "error": 2}
        assert evaluate(results)["steps_lost.error"]["met"] is False

    def test_hang_false_positives_of_every_section_add_up(self) -> None:
        """Each section's supervised runs report their hang_detected where no hang was made; the gate is the sum."""
        from bench.__main__ import _merge

        results: dict = {}
        _merge(results, {"throughput_ratio": 1.0, "hang_false_positives": [0, 0, 0, 0, 0]})
        _merge(results, {"hang_recovery_s": {"auto_beyond_threshold": 2.0}, "hang_false_positives": [0, 1]})
        assert results["hang"] == {"false_positives": 1, "runs_checked": 7, "per_run": [0, 0, 0, 0, 0, 0, 1]}
        assert evaluate(results)["hang.false_positives"]["met"] is False

    def test_throughput_spread(self) -> None:
        """The pairs' ratios: min, max and interquartile range."""
        from bench.throughput import spread

        assert spread([0.98, 1.0, 0.99, 1.02, 0.97]) == {"min": 0.97, "max": 1.02, "iqr": 0.02}
        assert spread([]) is None

    def test_unknown_section_is_a_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--only with a name that is no benchmark exits 2 naming it, before running anything."""
        with pytest.raises(SystemExit) as exc:
            main(["--only", "recovery,warp", "--out", "/nonexistent/x.json"])
        assert exc.value.code == 2 and "warp" in capsys.readouterr().err


class TestHelpers:
    def test_trainer_argv_and_progress_lines(self) -> None:
        """Flags become trainer options (True: a bare switch); rank-0 progress lines parse to (step, tokens/s)."""
        argv = trainer_argv(Path("/c"), steps=5, async_save=True, resume=None)
        assert argv == ["-m", "trainer", "--checkpoint-dir", "/c", "--steps", "5", "--async-save"]
        text = ("ts level=info event=train rank=0 step=10 loss=5.1 tokens_per_s=900 s_per_step=0.1\n"
                "ts level=info event=train rank=1 step=10 loss=5.1 tokens_per_s=1 s_per_step=0.1\n")
        assert train_lines(text) == [(10, 900)]

    def test_save_stall_reduce(self) -> None:
        """Medians and ratios come out of the job's samples as documented; write speed is judged per round."""
        samples = {"sync": [2.0, 1.0, 3.0], "async": [0.2] * 3, "memcpy": [0.1] * 3, "clone": [0.3] * 3,
                   "async_write": [2.5] * 3, "async_extra": [0.4] * 3, "full": [4.0] * 3,
                   "checkpoint_gbps": [0.5, 0.3, 0.6], "dd_gbps": [1.0, 0.3, 0.5]}
        rounds = [{"checkpoint": c, "dd_fsync": d, "ratio": round(c / d, 4)}
                  for c, d in zip(samples["checkpoint_gbps"], samples["dd_gbps"])]
        r = reduce({"samples": samples, "write_rounds": rounds, "checkpoint_bytes": 10, "state_bytes": 2**20,
                    "params": 7, "step_s": 0.1, "repeats": 3})
        assert r["save_stall_s"]["async_over_sync"] == 0.1 and r["save_stall_s"]["async_over_memcpy"] == 2.0
        # the median of the rounds' own ratios (1.0), not the ratio of the medians (0.5 / 0.5)
        w = r["write_gbps_small"]
        assert w["ratio"] == 1.0 and w["ratio_spread"] == [0.5, 1.2] and w["rounds"] == rounds
        assert (w["checkpoint"], w["dd_fsync"]) == (0.5, 0.5)
        assert r["dcp_vs_torch_save"]["torch_save_over_dcp"] == 2.0
        assert r["save_samples"] == samples  # every sample reaches the JSON, not only the medians

    def test_checkpoint_io_reduce(self) -> None:
        """write_gbps and load_gbps: medians, the median of the rounds' ratios and its spread, the cold method."""
        from bench.checkpoint_io import reduce as io_reduce

        writes = [{"checkpoint": 0.5, "dd_fsync": 1.0, "ratio": 0.5},
                  {"checkpoint": 0.6, "dd_fsync": 0.6, "ratio": 1.0},
                  {"checkpoint": 0.4, "dd_fsync": 0.5, "ratio": 0.8}]
        loads = [{"checkpoint": 1.0, "dd": 2.0, "ratio": 0.5}, {"checkpoint": 0.9, "dd": 1.0, "ratio": 0.9},
                 {"checkpoint": 0.8, "dd": 1.0, "ratio": 0.8}]
        samples = {"save_gbps": [0.5, 0.6, 0.4], "dd_fsync_gbps": [1.0, 0.6, 0.5], "save_s": [1, 2, 3],
                   "dd_fsync_s": [1, 1, 1], "load_gbps": [1.0, 0.9, 0.8], "dd_gbps": [2.0, 1.0, 1.0],
                   "load_s": [1, 2, 3], "dd_s": [1, 1, 2]}
        r = io_reduce({"samples": samples, "write_rounds": writes, "load_rounds": loads, "cache": "fadvise",
                       "bytes": 5, "save_bytes": 6, "files": 3, "tensors_per_rank": 4, "world_size": 2})
        w, ld = r["write_gbps"], r["load_gbps"]
        assert (w["checkpoint"], w["dd_fsync"], w["ratio"], w["ratio_spread"]) == (0.5, 0.6, 0.8, [0.5, 1.0])
        assert (ld["checkpoint"], ld["dd"], ld["ratio"], ld["cache"]) == (0.9, 1.0, 0.8, "fadvise")
        assert w["rounds"] == writes and ld["rounds"] == loads and ld["ranks"] == 2 and w["bytes"] == 6


class TestLoopProbe:
    def test_records_lateness_and_writes_json(self, tmp_path: Path) -> None:
        """Each tick records how late it ran against the previous tick's deadline; the file holds them all."""
        from bench.loopprobe import INTERVAL_S, LoopProbe

        now = [100.0]
        probe = LoopProbe(tmp_path / "p.json", clock=lambda: now[0])
        for late in (None, 0.0, 0.25, 0.002):
            if late is not None:
                now[0] += INTERVAL_S + late
            probe.tick()
        probe.write()
        doc = json.loads((tmp_path / "p.json").read_text())
        assert doc["max_late_s"] == 0.25 and [round(x, 3) for _, x in doc["samples"]] == [0.0, 0.25, 0.002]

    def test_off_without_the_variable(self, tmp_path: Path) -> None:
        """Without FSDP_SUPERVISOR_LOOP_PROBE there is no probe; with it, one writing to that path."""
        from bench.loopprobe import PROBE_ENV, LoopProbe

        assert LoopProbe.from_env({}) is None
        probe = LoopProbe.from_env({PROBE_ENV: str(tmp_path / "x.json")})
        assert probe is not None and probe.path == tmp_path / "x.json"


class TestCampaign:
    """bench/campaign.py's fault injection (its judging is the daemon's own pass: tests/unit/test_seals.py)."""

    @staticmethod
    def ckpt(where: Path, fill: int) -> Path:
        where.mkdir(parents=True)
        (where / "__0_0.distcp").write_bytes(bytes([fill]) * 10000)
        (where / ".metadata").write_bytes(bytes([fill + 1]) * 300)
        return where

    @pytest.mark.parametrize("kind", ["bit_flip", "zero_page", "truncate", "shard_swap", "metadata_swap"])
    def test_every_kind_changes_the_bytes_and_a_flip_keeps_the_times(self, tmp_path: Path, kind: str) -> None:
        import os
        import random

        from bench.campaign import inject

        before, ckpt = self.ckpt(tmp_path / "step_5", 1), self.ckpt(tmp_path / "step_10", 7)
        was = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ckpt.iterdir()}
        for seed in range(20):
            what = inject(kind, ckpt, before, random.Random(seed))
            assert what is not None
            now = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ckpt.iterdir()}
            changed = [n for n in was if now[n][0] != was[n][0]]
            assert len(changed) == 1, what
            if kind in ("bit_flip", "zero_page"):
                assert now[changed[0]][1] == was[changed[0]][1] and len(now[changed[0]][0]) == len(was[changed[0]][0])
                diff = [i for i, (a, b) in enumerate(zip(now[changed[0]][0], was[changed[0]][0])) if a != b]
                assert len(diff) == 1 if kind == "bit_flip" else 0 < len(diff) <= 4096
                if kind == "bit_flip":
                    assert bin(now[changed[0]][0][diff[0]] ^ was[changed[0]][0][diff[0]]).count("1") == 1
            for p in ckpt.iterdir():  # back as it was, for the next seed
                p.write_bytes(was[p.name][0])
                os.utime(p, ns=(was[p.name][1], was[p.name][1]))

    def test_no_such_fault(self, tmp_path: Path) -> None:
        """A swap from a checkpoint with the same bytes, a zeroed page of a file of zeros: nothing to inject."""
        import random

        from bench.campaign import inject

        before, ckpt = self.ckpt(tmp_path / "a", 0), self.ckpt(tmp_path / "b", 0)
        (ckpt / ".metadata").write_bytes(bytes(300))
        (before / ".metadata").write_bytes(bytes(300))
        assert inject("shard_swap", ckpt, before, random.Random(0)) is None
        assert inject("metadata_swap", ckpt, before, random.Random(0)) is None
        (ckpt / "__0_0.distcp").write_bytes(bytes(10000))
        assert inject("zero_page", ckpt, before, random.Random(0)) is None
