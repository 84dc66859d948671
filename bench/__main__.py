"""`make bench`: run every benchmark, print a table, write bench-results.json at the repo root.

    python -m bench                       # everything (about 30 minutes on 2 cores)
    python -m bench --only throughput     # one benchmark (its gated keys alone: see SECTIONS and GOALS)
    python -m bench --only recovery,imports --repeats 5
    python -m bench --quick               # tiny sizes, one repeat: checks that everything runs

Benchmarks report; they never fail on a missed goal (the table and the JSON say which were missed).
The exit code is 1 only if a benchmark could not run at all.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import REPO, machine, scratch
from bench.local_tier import K as LOCAL_K

__all__ = ["main", "GOALS", "evaluate", "render"]

SECTIONS = ("imports", "discovery", "metadata", "recovery", "hangs", "heartbeat", "save_stall", "checkpoint_io",
            "loop_stall", "throughput", "local_tier", "integrity", "campaign", "divergence", "hang_auto", "notify",
            "soak")
# (dotted key in bench-results.json, comparison, goal) from issues 7, 12, 25 and 26.
GOALS: list[tuple[str, str, float]] = [
    ("recovery_s.ratio", "<=", 0.5),  # issue 26: every rank back (world size unchanged), through warm workers
    ("recovery_s.breakdown.supervisor.worker_init", "<=", 1.2),
    ("save_stall_s.async_over_sync", "<=", 0.25),
    ("save_stall_s.async_over_memcpy", "<=", 3.0),
    ("write_gbps.ratio", ">=", 0.8),
    ("supervisor.rss_mb", "<=", 60.0),
    ("supervisor.idle_cpu_pct", "<=", 1.0),
    ("supervisor.import_s", "<=", 0.5),
    ("discovery_ms.n1000", "<=", 200.0),
    ("throughput_ratio", ">=", 0.99),  # issue 37: the median of >= 5 interleaved pairs (throughput.ratio_spread)
    # The .metadata reader on Llama-3 70B FSDP2 checkpoints (bench.discovery.run_large).
    ("discovery_ms.llama70b_r64", "<=", 1000.0),  # newest complete over a 70B x 64 save, nothing cached: under 1 s
    ("parse_vs_torch_ratio", "<=", 0.5),  # our parse / torch's own pickle.load, 64 ranks, same process
    ("metadata_parse.peak_rss_x", "<=", 3.0),  # parse's peak RSS growth / file size, 64 ranks
    ("metadata_parse.linearity", "<=", 1.5),  # worst / best ms per MB over 64, 256 and 1024 ranks
    ("load_gbps.ratio", ">=", 0.8),
    ("loop_stall_ms_max", "<=", 50.0),
    ("signal_latency_during_verify_s", "<=", 0.5),
    # Issue 25: a hang costs seconds beyond hang_timeout_s, every rank's heartbeat costs nothing, losses are exact.
    ("hang_recovery_s.beyond_timeout", "<=", 6.0),
    ("heartbeat.per_rank_overhead", ">=", 0.99),
    ("steps_lost.error", "<=", 0.0),  # the largest |reported - true| over the supervised recovery rounds
    # Issue 26: the node-local tier (bench/local_tier.py; its K is reported as local_tier.k).
    ("local_tier.throughput_ratio", ">=", 0.97),  # local saves every K steps / none
    ("local_tier.steps_lost_median", "<=", float(LOCAL_K)),
    ("local_tier.load_speedup", ">=", 2.0),  # cold 1.2 GB load: the durable root's time / the local tier's
    # Issue 34: checksums written while saving cost (almost) nothing; the supervisor's check reads near dd's speed.
    ("integrity.write_overhead", "<=", 0.03),
    ("integrity.verify_ratio", ">=", 0.8),
    ("integrity.campaign.caught_pct", ">=", 100.0),  # injected faults the resume decision set aside (bench/campaign.py)
    ("integrity.campaign.resumed", "<=", 0.0),  # ... and the ones it would have resumed
    ("divergence.false_positives", "<=", 0.0),  # issue 33: diverged events over the benchmark's healthy training
    # Issue 37: hang detection on by default ("auto"), and alerts.
    ("hang_recovery_s.auto_beyond_threshold", "<=", 3.0),  # no [health]: the threshold reached -> the first step back
    ("hang.false_positives", "<=", 0.0),  # hang_detected where none was made, over the supervised runs of this bench
    ("notify.latency_s", "<=", 1.0),  # an event -> its webhook's receipt on loopback
    ("soak.rss_growth_kb_per_100_attempts", "<=", 50.0),  # issue 37: flat over a month of quick crashes (bench/soak.py)
]
# Context rows printed under the goals (not gated).
INFO = [
    "recovery_s.supervisor", "recovery_s.torchrun_restart", "recovery_s.naive_loop",
    "hang_recovery_s.median", "hang_recovery_s.torchrun", "heartbeat.per_rank_overhead_cpu", "heartbeat.per_beat_us",
    "heartbeat.step_s", "steps_lost.errors",
    "save_stall_s.sync", "save_stall_s.async", "save_stall_s.memcpy_floor", "save_stall_s.memcpy_clone",
    "discovery_ms.llama70b_r256", "discovery_ms.llama70b_r1024",
    "metadata_parse.llama70b_r64.metadata_mb", "metadata_parse.llama70b_r256.metadata_mb",
    "metadata_parse.llama70b_r1024.metadata_mb", "metadata_parse.llama70b_r1024.generate_s",
    "write_gbps.checkpoint", "write_gbps.dd_fsync", "write_gbps.ratio_spread", "write_gbps_small.ratio",
    "write_gbps_small.checkpoint", "write_gbps_small.dd_fsync", "load_gbps.checkpoint", "load_gbps.dd",
    "load_gbps.ratio_spread", "load_gbps.cache", "loop.verify_s", "loop.loop_stall_ms_p99", "loop.idle_stall_ms_max",
    "loop.job_exit_reaped_s", "loop.job_exited_log_s", "dcp_vs_torch_save.dcp_sharded_save_s",
    "dcp_vs_torch_save.full_state_dict_torch_save_s", "supervisor_verify_s", "supervisor.spare_rss_mb",
    "tokens_per_s.supervisor", "tokens_per_s.bare",
    "warm_workers.idle_rss_mb", "warm_workers.idle_uss_mb", "warm_workers.workers",
    "local_tier.k", "local_tier.cpu_per_step_ratio", "local_tier.recovery_s", "local_tier.load_s.durable",
    "local_tier.load_s.local", "divergence.rollback_s", "divergence.steps_checked",
    "integrity.campaign.faults", "integrity.campaign.to_previous", "integrity.campaign.relaunch.exit_to_detection_s",
    "integrity.campaign.relaunch.detection_to_relaunch_s", "integrity.campaign.relaunch.exit_to_relaunch_s",
    "throughput.round_ratios", "throughput.ratio_spread.min", "throughput.ratio_spread.max", "throughput.ratio_spread.iqr",
    "supervisor.loop_switches_per_s", "supervisor.switches_per_s", "hang_recovery_s.auto_threshold_s",
    "hang_recovery_s.auto_beyond_threshold_all", "hang.runs_checked", "notify.latency_s_max", "notify.alerts",
    "soak.attempts", "soak.start.fds", "soak.end.fds", "soak.start.threads", "soak.end.threads", "soak.start.status_s",
    "soak.end.status_s", "soak.start.metrics_s", "soak.end.metrics_s",
]


def lookup(results: dict[str, Any], dotted: str) -> Any:
    node: Any = results
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def evaluate(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{key: {value, goal, met}} for every goal; `met` is None when the value is missing."""
    out = {}
    for key, op, goal in GOALS:
        value = lookup(results, key)
        met = None if value is None else (value <= goal if op == "<=" else value >= goal)
        out[key] = {"value": value, "goal": f"{op} {goal:g}", "met": met}
    return out


def render(results: dict[str, Any]) -> str:
    """The table `make bench` prints: goals first, then context figures."""
    rows = [("metric", "value", "goal", "")]
    for key, g in evaluate(results).items():
        mark = {True: "ok", False: "MISSED", None: "n/a"}[g["met"]]
        rows.append((key, _fmt(g["value"]), g["goal"], mark))
    for key in INFO:
        if lookup(results, key) is not None:
            rows.append((key, _fmt(lookup(results, key)), "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "-" if v is None else str(v)


def _sections(quick: bool, repeats: int | None, say: Callable[[str], None]) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each section returns the top-level keys it contributes."""

    def imports() -> dict[str, Any]:
        from bench.supervisor_cost import import_seconds

        return {"supervisor": import_seconds(repeats=2 if quick else 5)}

    def discovery() -> dict[str, Any]:
        # Only the gated figure and its torn-newest variant: bench.discovery's full scans take a minute here.
        import shutil

        from bench import discovery as d
        from supervisor.checkpoints import newest_complete

        n, shards, reps = (50, 16, 2) if quick else (1000, 16, 7)
        root = scratch("discovery")
        try:
            d.build_root(root, n, shards)
            out = {f"n{n}": d._median_ms(lambda: newest_complete(root), reps)}
            for i in range(n, n - 10, -1):  # the 10 newest lose a shard: 11 dirs verified before a hit
                (root / f"step_{100 * i:08d}" / f"__{shards - 1}_0.distcp").unlink()
            out[f"n{n}_newest10_torn"] = d._median_ms(lambda: newest_complete(root), reps)
            return {"discovery_ms": {**out, "shards": shards, "repeats": reps}}
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def metadata() -> dict[str, Any]:
        # One synthetic 70B checkpoint per rank count, generated here (70B x 1024: ~2 min, ~5 GB of RAM).
        from bench import discovery as d

        if quick:
            return d.run_large(model="tiny", ranks=(4, 16), repeats=1, torch_ranks=4)
        return d.run_large(repeats=repeats or 3)

    def recovery() -> dict[str, Any]:
        from bench import recovery as rec

        r = rec.run(repeats=1 if quick else (repeats or 4), kill_step=5 if quick else 12, progress=say)
        return {"recovery_s": r, "steps_lost_errors": r.pop("steps_lost_errors"), "warm_workers": rec.warm_workers(r),
                "hang_false_positives": r.pop("hang_false_positives")}

    def hangs() -> dict[str, Any]:
        from bench import hangs as h

        if quick:  # a smoke run: one supervised round of a tiny job with a short timeout, no bare torchrun
            return h.run(repeats=1, torchrun_repeats=0, hang_timeout_s=3, kill_step=5, progress=say,
                         model={"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2})
        return h.run(repeats=repeats or 3, progress=say)

    def heartbeat() -> dict[str, Any]:
        from bench import heartbeat as hb

        return hb.run(rounds=4 if quick else 60)

    def save_stall() -> dict[str, Any]:
        from bench import save_stall as ss

        model = {"d_model": 64, "n_layers": 2, "n_heads": 4} if quick else None
        return ss.run(repeats=1 if quick else (repeats or 3), model=model)

    def checkpoint_io() -> dict[str, Any]:
        from bench import checkpoint_io as cio

        if quick:
            return cio.run(repeats=1, gb=0.02, d_model=128, ranks=1, settle_s=0.0)  # a smoke run: no figures
        return cio.run(repeats=repeats or 3)

    def loop_stall() -> dict[str, Any]:
        from bench import loop_stall as ls

        return ls.run(repeats=1 if quick else (repeats or 3), size=ls.QUICK_SIZE if quick else ls.SIZE)

    def throughput() -> dict[str, Any]:
        from bench import throughput as tp

        r = tp.run(repeats=1 if quick else max(5, repeats or 5), window_s=3 if quick else 12, warmup_s=1 if quick else 4,
                   progress=say)
        return {"throughput_ratio": r.pop("throughput_ratio"), "supervisor": r.pop("supervisor"),
                "tokens_per_s": r.pop("tokens_per_s"), "hang_false_positives": r.pop("hang_false_positives"),
                "throughput": r}

    def local_tier() -> dict[str, Any]:
        from bench import local_tier as tier

        return {"local_tier": tier.run(repeats=1 if quick else (repeats or 3), quick=quick, progress=say)}

    def integrity() -> dict[str, Any]:
        from bench import integrity as ig

        if quick:  # a smoke run: no figures
            return {"integrity": ig.run(mb=64, repeats=1, pairs=2, settle_s=0.0)}
        return {"integrity": ig.run(mb=512, repeats=repeats or 5)}

    def campaign() -> dict[str, Any]:
        from bench import campaign as cp

        return {"integrity": {"campaign": cp.run(scale=0.02 if quick else 1.0, relaunches=1 if quick else 5)}}

    def divergence() -> dict[str, Any]:
        from bench import divergence as dv

        return {"divergence": dv.run(repeats=1 if quick else (repeats or 2), steps=60 if quick else 200)}

    def hang_auto() -> dict[str, Any]:
        from bench import hangs as h

        return h.run_auto(repeats=1 if quick else (repeats or 3), progress=say)

    def notify() -> dict[str, Any]:
        from bench import notify as n

        return {"notify": n.run(repeats=1 if quick else (repeats or 3))}

    def soak() -> dict[str, Any]:
        from bench import soak as sk

        return {"soak": sk.run(attempts=20 if quick else 200, warmup=5 if quick else sk.WARMUP)}

    return {"divergence": divergence, "hang_auto": hang_auto, "notify": notify, "soak": soak,
            "imports": imports, "discovery": discovery, "metadata": metadata, "recovery": recovery, "hangs": hangs,
            "heartbeat": heartbeat, "save_stall": save_stall, "checkpoint_io": checkpoint_io, "loop_stall": loop_stall,
            "throughput": throughput, "local_tier": local_tier, "integrity": integrity, "campaign": campaign}


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    errors = new.pop("steps_lost_errors", None)  # reported - true, per supervised round of recovery and hangs
    if errors:
        seen = [*into.get("steps_lost", {}).get("errors", []), *errors]
        known = [abs(e) for e in seen if e is not None]
        into["steps_lost"] = {"errors": seen, "error": max(known) if known else None}
    hangs = new.pop("hang_false_positives", None)  # per supervised run: hang_detected where no hang was made
    if hangs is not None:
        seen = [*into.get("hang", {}).get("per_run", []), *hangs]
        into["hang"] = {"false_positives": sum(seen), "runs_checked": len(seen), "per_run": seen}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key].update(value)
        else:
            into[key] = value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description="Run the benchmarks of issue 7.")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=None,
                   help="repetitions of each compared run (default: 4 for recovery, 5 pairs (at least) for "
                   "throughput, 3 for the others)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and one repeat (a smoke run, not figures)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results.json", help="where the JSON goes")
    a = p.parse_args(argv)
    chosen = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(unknown)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "FSDP_SUPERVISOR_CACHE_DIR" not in os.environ:
        # The .metadata summary cache goes to a scratch dir: every run starts cold, and ~/.cache is left alone.
        cache = scratch("metadata-cache")
        os.environ["FSDP_SUPERVISOR_CACHE_DIR"] = str(cache)
        atexit.register(shutil.rmtree, cache, ignore_errors=True)

    def say(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    probe = scratch("machine")
    results: dict[str, Any] = {"machine": machine(probe), "started_at": datetime.now(timezone.utc).isoformat(),
                               "quick": a.quick, "repeats": a.repeats, "seconds": {}, "errors": {}}
    probe.rmdir()
    sections = _sections(a.quick, a.repeats, say)
    for name in chosen:
        say(f"{name} ...")
        start = time.monotonic()
        try:
            _merge(results, sections[name]())
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
            results["errors"][name] = traceback.format_exc(limit=5)
            say(f"{name} FAILED:\n{results['errors'][name]}")
        results["seconds"][name] = round(time.monotonic() - start, 1)
    results["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["goals"] = evaluate(results)
    a.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(render(results))
    print(f"\nwritten: {a.out}  ({sum(results['seconds'].values()):.0f} s; load average at start "
          f"{results['machine']['load_avg_at_start']}, at end {results['machine']['load_avg_at_end']})")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
