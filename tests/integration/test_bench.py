"""Smoke tests of the benchmarks (issues 7 and 12): each one runs at a tiny size and returns the documented keys.

Benchmarks report timings; these tests never judge a timing, only shapes, signs and the goal arithmetic.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2}


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and x > 0


class TestBenchmarksRun:
    def test_recovery_variants(self) -> None:
        """The two gated recovery variants recover and report a total and five non-negative phases. (The naive
        loop, an ungated baseline, shares their measuring code and is left to `make bench`: ~17 s of CI.)"""
        from bench.recovery import PHASES, run

        variants = ("supervisor", "torchrun_restart")
        r = run(repeats=1, kill_step=3, model=TINY, variants=variants)
        for v in variants:
            assert _positive(r[v]) and set(r["breakdown"][v]) == set(PHASES)
            assert all(x >= 0 for x in r["breakdown"][v].values())
        assert _positive(r["ratio"])
        assert "prewarm_handoff" in r["runs"]["supervisor"][0]["supervisor_events"]
        warm = r["runs"]["supervisor"][0]["warm_workers"]  # measured at steady state: the idle spare's two workers
        assert warm["workers"] == 2 and _positive(warm["idle_rss_mb"]) and warm["idle_uss_mb"] <= warm["idle_rss_mb"]

    def test_local_tier_recovery_and_load(self) -> None:
        """A recovery round with the tier on resumes from it and counts the steps lost; the load comparison runs
        (tiny sizes: its throughput comparison shares bench/throughput.py's measuring, left to `make bench`)."""
        from bench.local_tier import load_speedup, recovery_rounds

        r = recovery_rounds(1, k=4, model=TINY)
        assert r["recovery_runs"][0]["resumed_tier"] == "local" and 0 <= r["steps_lost_median"] <= 4
        load = load_speedup(1, gb=0.01, d_model=64, ranks=1)
        assert _positive(load["load_speedup"]) and _positive(load["load_s"]["local"])

    def test_hang_recovery_and_heartbeat_cost(self) -> None:
        """One supervised hang (SIGSTOP of rank 1, a 3 s timeout) recovers with its phases and exact steps lost;
        the per-rank heartbeat's A/B job runs. (Bare torchrun's hang takes over a minute: `make bench` only.)"""
        from bench import hangs, heartbeat

        r = hangs.run(repeats=1, torchrun_repeats=0, hang_timeout_s=3, kill_step=5, model=TINY)
        h = r["hang_recovery_s"]
        assert _positive(h["median"]) and h["beyond_timeout"] == pytest.approx(h["median"] - 3, abs=1e-3)
        assert _positive(h["breakdown"]["supervisor"]["detection"]) and r["steps_lost_errors"] == [0]
        run = h["runs"]["supervisor"][0]  # measured from the threshold status named, the job's last step by its clock
        assert run["threshold_s"] == 3 and run["beyond_threshold"] > 0 and r["hang_false_positives"] == [0]
        hb = heartbeat.run(rounds=2, block=2, model=TINY)["heartbeat"]
        assert _positive(hb["per_rank_overhead"]) and _positive(hb["per_beat_us"])

    def test_save_stall_and_write_speed(self, tmp_path: Path) -> None:
        """The checkpoint job measures every kind and reduces to the issue's keys."""
        from bench.save_stall import run

        r = run(repeats=1, model=TINY, data_dir=tmp_path)
        for key in ("sync", "async", "memcpy_floor", "async_over_sync", "async_over_memcpy"):
            assert _positive(r["save_stall_s"][key]), key
        for key in ("checkpoint", "dd_fsync", "ratio"):
            assert _positive(r["write_gbps_small"][key]), key
        assert len(r["write_gbps_small"]["rounds"]) == 1
        assert _positive(r["dcp_vs_torch_save"]["full_state_dict_torch_save_s"]) and _positive(r["supervisor_verify_s"])
        # The measured saves are cleaned up; one checkpoint is left for timing the supervisor's verify().
        assert sorted(p.name for p in tmp_path.iterdir()) == ["job.log", "result.json", "sync"]
        assert len(list((tmp_path / "sync").iterdir())) == 1

    def test_checkpoint_io_and_loop_sections(self, tmp_path: Path) -> None:
        """`--quick` runs the I/O and loop benchmarks: their keys, a cold-read method, work during a pass."""
        out = tmp_path / "r.json"
        assert main(["--only", "checkpoint_io,loop_stall", "--quick", "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        for key, dd, rounds in (("write_gbps", "dd_fsync", 1), ("load_gbps", "dd", 2)):  # loads: both orders
            assert all(_positive(doc[key][k]) for k in ("checkpoint", dd, "ratio"))
            assert len(doc[key]["rounds"]) == rounds
        assert doc["load_gbps"]["cache"] in ("drop_caches", "fadvise", "warm")
        assert doc["loop_stall_ms_max"] >= 0 and _positive(doc["signal_latency_during_verify_s"])
        run = doc["loop"]["runs"][0]
        assert run["signal_during_verify"] and run["exit_during_verify"] and run["ticks"] > 0
        assert _positive(doc["loop"]["job_exit_reaped_s"]) and _positive(doc["loop"]["job_exited_log_s"])
        assert {"load_gbps.ratio", "loop_stall_ms_max", "signal_latency_during_verify_s"} <= set(doc["goals"])

    def test_integrity_and_campaign_sections(self, tmp_path: Path) -> None:
        """`--quick` runs issue 34's sections: both timing ratios, and a small campaign over real checkpoints of both
        layouts whose every fault the pass sets aside (never resumed, the one before chosen), in the judging and in
        the two real `run` relaunches."""
        out = tmp_path / "r.json"
        assert main(["--only", "integrity,campaign", "--quick", "--out", str(out)]) == 0
        doc = json.loads(out.read_text())["integrity"]
        assert _positive(doc["verify_ratio"]) and isinstance(doc["write_overhead"], float)
        assert len(doc["write_ratios"]) == 2 and doc["cache"] in ("drop_caches", "fadvise")
        c = doc["campaign"]
        assert c["faults"] >= 20 and c["caught"] == c["to_previous"] == c["faults"] and c["resumed"] == 0
        assert set(c["per_kind"]) == {"bit_flip", "zero_page", "truncate", "shard_swap", "metadata_swap"}
        assert set(c["layouts"]) == {"trainer", "plain_dcp"} and c["layouts"]["plain_dcp"]["sealed"]
        runs = c["relaunch"]["runs"]
        assert len(runs) == 2 and all(r["rc"] == 0 and r["to_previous"] and not r["resumed_rotten"] for r in runs), runs

    def test_throughput_and_supervisor_cost(self) -> None:
        """Both variants train; the supervisor's RSS and CPU are sampled in the same window."""
        from bench.throughput import run

        r = run(repeats=1, window_s=2, warmup_s=1, model=TINY)
        assert _positive(r["throughput_ratio"])
        assert _positive(r["supervisor"]["rss_mb"]) and r["supervisor"]["idle_cpu_pct"] >= 0
        assert _positive(r["supervisor"]["loop_switches_per_s"]) and r["hang_false_positives"] == [0]
        assert r["ratio_spread"]["min"] == r["ratio_spread"]["max"] == r["throughput_ratio"]

    def test_notify_latency(self) -> None:
        """A crash loop's two default alerts reach a loopback webhook, each timed from its event's `at`."""
        from bench.notify import run

        r = run(repeats=1)
        assert r["events"] == ["crash_loop", "gave_up"] and r["alerts"] == 2 and _positive(r["latency_s"])

    def test_import_times(self) -> None:
        """Fresh-interpreter import timings are measured for the CLI and the run path."""
        from bench.supervisor_cost import import_seconds

        r = import_seconds(repeats=1)
        assert all(_positive(r[k]) for k in ("python_startup_s", "library_floor_s", "status_imports_s", "import_s",
                                              "version_s"))

    def test_import_s_covers_everything_run_imports(self, tmp_path: Path) -> None:
        """A real `run` (of a job that exits at once) imports no module beyond what `import_s` times.

        Nor torch, nor `http.server` (only a configured `[metrics] listen` needs it)."""
        import subprocess
        import sys

        from bench.supervisor_cost import RUN_IMPORTS
        from tests.supervise import write_config

        cfg = write_config(tmp_path, [sys.executable, "-c", "pass"])
        show = "\nimport sys\nprint(' '.join(sorted(sys.modules)))\n"
        real = subprocess.run([sys.executable, "-c", "from supervisor.cli import app as cli\n"
                               f"assert cli.main(['run', '-c', {str(cfg)!r}]) == 0" + show],
                              capture_output=True, text=True, timeout=60, check=True)
        timed = subprocess.run([sys.executable, "-c", RUN_IMPORTS + show],
                               capture_output=True, text=True, timeout=60, check=True)
        ours = {m for m in real.stdout.split() if m.startswith("supervisor")}
        assert {"supervisor.daemon.core", "supervisor.daemon.loop"} <= ours, real.stderr
        assert ours - set(timed.stdout.split()) == set()
        assert {"torch", "http.server"} & set(real.stdout.split()) == set()

    def test_cli_writes_json_and_table(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`python -m bench --only imports` writes the JSON (machine facts, goals) and prints the table."""
        out = tmp_path / "r.json"
        assert main(["--only", "imports", "--quick", "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["machine"]["cores"] >= 1 and doc["machine"]["disk"]["filesystem"]
        assert doc["goals"]["supervisor.import_s"]["met"] in (True, False)
        assert "supervisor.import_s" in capsys.readouterr().out
