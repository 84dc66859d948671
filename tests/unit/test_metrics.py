"""Prometheus rendering from `Status`, the listen address rules, and the /metrics endpoint of a real supervisor."""
from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from supervisor.errors import ConfigError
from supervisor.observe.metrics import CONTENT_TYPE, MetricsServer, parse_listen, render_metrics
from supervisor.policy.state import ExitInfo, State, Status
from tests.supervise import FAKEJOB, REPO, Supervisors, cli, stop, supervisors, wait_for, write_config  # noqa: F401

_SAMPLE = re.compile(r'^([a-z_]+)(\{[a-z_]+="(?:[^"\\]|\\.)*"(?:,[a-z_]+="(?:[^"\\]|\\.)*")*\})? (\S+)$')


def parse(text: str) -> dict[str, list[tuple[str, float]]]:
    """A strict reader of the text format: every family has HELP then TYPE, then well-formed samples (a
    histogram's are `_bucket{le}` counts, cumulative up to le="+Inf", then `_sum` and `_count` = the +Inf count)."""
    out: dict[str, list[tuple[str, float]]] = {}
    declared: list[str] = []
    kinds: dict[str, str] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            declared.append(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == declared[-1] and kind in ("gauge", "counter", "histogram")
            kinds[name] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"malformed sample line: {line!r}"
            family = declared[-1]
            names = (f"{family}_bucket", f"{family}_sum", f"{family}_count") if kinds[family] == "histogram" else (family,)
            assert m.group(1) in names, f"sample outside its family: {line!r}"
            out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    for family in (f for f, k in kinds.items() if k == "histogram"):
        counts = [v for _, v in out[f"{family}_bucket"]]
        assert counts == sorted(counts) and out[f"{family}_bucket"][-1][0] == '{le="+Inf"}'
        assert out[f"{family}_count"] == [("", counts[-1])] and len(out[f"{family}_sum"]) == 1
    assert len(declared) == len(set(declared)), "a family is declared twice"
    return out


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def running_status() -> Status:
    return Status(
        state=State.RUNNING, pid=1, attempt=3, restarts=2, started_at=1000.0, step=120, step_at=1990.0,
        rate_steps_per_s=1.5, loss=2.25, latest_checkpoint={"path": "/c/step_00000100", "step": 100, "mtime": 1900.0},
        disk_free_bytes=5 * 2**30, quarantined=["/c/step_00000050"], updated_at=1995.0,
        last_exit=ExitInfo(code=1, signal=None, reason='crash "rank 1"', at=1500.0),
    )


class TestRenderMetrics:
    def test_values_of_a_running_job(self) -> None:
        """Every field the issue names is exported with the status's value; the age is now - mtime."""
        st = running_status()
        st.checkpoint_bytes = 12345
        m = parse(render_metrics(st, now=2000.0))
        v = {name: samples[0][1] for name, samples in m.items() if len(samples) == 1}
        assert v["fsdp_supervisor_restarts_total"] == 2 and v["fsdp_supervisor_job_step"] == 120
        assert v["fsdp_supervisor_last_checkpoint_step"] == 100
        assert v["fsdp_supervisor_last_checkpoint_age_seconds"] == 100.0
        assert v["fsdp_supervisor_checkpoint_bytes"] == 12345 and v["fsdp_supervisor_disk_free_bytes"] == 5 * 2**30
        assert v["fsdp_supervisor_attempt"] == 3 and v["fsdp_supervisor_quarantined_checkpoints"] == 1
        assert v["fsdp_supervisor_rollbacks_total"] == 0

    def test_rollbacks_are_counted(self) -> None:
        st = running_status()
        st.rollbacks = 2
        assert parse(render_metrics(st, now=2000.0))["fsdp_supervisor_rollbacks_total"] == [("", 2.0)]

    def test_history_numbers(self) -> None:
        """Goodput, the restart latency histogram, the steps-lost counter and the last val_loss come from Status."""
        st = running_status()
        st.goodput, st.restart_latency_s, st.steps_lost, st.val_loss = 0.75, [0.5, 4.0, 45.0], [3, 9], 1.25
        st.steps_lost_total = 12
        m = parse(render_metrics(st, now=2000.0))
        assert m["fsdp_supervisor_goodput"] == [("", 0.75)] and m["fsdp_supervisor_job_val_loss"] == [("", 1.25)]
        assert m["fsdp_supervisor_steps_lost_total"] == [("", 12.0)]
        buckets = dict(m["fsdp_supervisor_restart_latency_seconds_bucket"])
        assert (buckets['{le="1"}'], buckets['{le="5"}'], buckets['{le="30"}'], buckets['{le="60"}']) == (1, 2, 2, 3)
        assert m["fsdp_supervisor_restart_latency_seconds_sum"] == [("", 49.5)]

    def test_ranks_stragglers_hangs_and_time_lost(self) -> None:
        """Every watched rank's step and step time, the straggler flag, the last hang's ranks, time lost by phase."""
        st = running_status()
        st.ranks = [{"rank": 0, "step": 57, "phase": "train", "step_s": 0.1, "at": 1.0, "straggler": False},
                    {"rank": 1, "step": 57, "phase": "train", "step_s": 0.4, "at": 1.0, "straggler": True}]
        st.stragglers = [1]
        st.last_hang = {"attempt": 2, "at": 1800.0, "step": 50, "idle_s": 10.0,
                        "ranks": [{"rank": 1, "why": "stopped"}], "stacks": None}
        st.time_lost_s = {"detection": 10.0, "stop": 2.5, "relaunch": 0.3, "worker_start": 3.9, "load": 1.7, "redo": 1.0}
        m = parse(render_metrics(st, now=2000.0))
        assert m["fsdp_supervisor_rank_step"] == [('{rank="0"}', 57), ('{rank="1"}', 57)]
        assert m["fsdp_supervisor_rank_step_seconds"] == [('{rank="0"}', 0.1), ('{rank="1"}', 0.4)]
        assert m["fsdp_supervisor_rank_straggler"] == [('{rank="0"}', 0), ('{rank="1"}', 1)]
        assert m["fsdp_supervisor_stragglers"] == [("", 1)]
        assert m["fsdp_supervisor_last_hang_timestamp_seconds"] == [('{ranks="1"}', 1800.0)]
        assert dict(m["fsdp_supervisor_time_lost_seconds_total"])['{phase="stop"}'] == 2.5

    def test_state_is_one_hot(self) -> None:
        """One sample per state, exactly the current one set to 1."""
        samples = parse(render_metrics(running_status(), now=2000.0))["fsdp_supervisor_state"]
        assert sorted(lab for lab, _ in samples) == sorted(f'{{state="{s.value}"}}' for s in State)
        assert [lab for lab, v in samples if v == 1] == ['{state="running"}']

    def test_unknown_values_are_left_out(self) -> None:
        """A fresh status (no step, no checkpoint, no disk figure) exports no sample for them instead of 0."""
        m = parse(render_metrics(Status(), now=5.0))
        for name in ("job_step", "last_checkpoint_step", "last_checkpoint_age_seconds", "checkpoint_bytes",
                     "disk_free_bytes", "last_exit_timestamp_seconds"):
            assert f"fsdp_supervisor_{name}" not in m
        assert m["fsdp_supervisor_restarts_total"] == [("", 0.0)]

    def test_label_values_are_escaped(self) -> None:
        """Quotes, backslashes and newlines in a label value stay inside the label."""
        st = running_status()
        st.last_exit = ExitInfo(code=None, signal="SIGKILL", reason='a"b\\c\nd', at=1.0)
        (labels, _), = parse(render_metrics(st, now=2.0))["fsdp_supervisor_last_exit_timestamp_seconds"]
        assert r'reason="a\"b\\c\nd"' in labels and 'signal="SIGKILL"' in labels and 'code=""' in labels


class TestParseListen:
    @pytest.mark.parametrize(("listen", "expected"), [
        ("127.0.0.1:9400", ("127.0.0.1", 9400)), ("9400", ("127.0.0.1", 9400)), (":9400", ("127.0.0.1", 9400)),
        ("localhost:9400", ("127.0.0.1", 9400)), ("[::1]:9400", ("::1", 9400)), ("0.0.0.0:9400", ("0.0.0.0", 9400)),
    ])
    def test_accepted(self, listen: str, expected: tuple[str, int]) -> None:
        """Loopback unless an address is written out; IPv6 in brackets."""
        assert parse_listen(listen) == expected

    @pytest.mark.parametrize("listen", ["metrics.example.com:9400", "127.0.0.1:http", "127.0.0.1:70000", "1.2.3:80"])
    def test_rejected(self, listen: str) -> None:
        """Host names (which could resolve to a public address) and bad ports are config errors naming the key."""
        with pytest.raises(ConfigError, match=r"\[metrics\] listen"):
            parse_listen(listen)


class TestMetricsServer:
    def test_get_metrics_and_404(self, tmp_path: Path) -> None:
        """GET /metrics returns the live status in the text format; other paths are 404; stop frees the port."""
        st = running_status()
        server = MetricsServer("127.0.0.1", 0, lambda: st, clock=lambda: 2000.0).start()
        try:
            host, port = server.address
            code, ctype, body = get(f"http://{host}:{port}/metrics")
            assert code == 200 and ctype == CONTENT_TYPE
            assert parse(body)["fsdp_supervisor_job_step"] == [("", 120.0)]
            st.step = 121  # the server reads the live object, not a copy taken at start
            assert parse(get(f"http://{host}:{port}/metrics")[2])["fsdp_supervisor_job_step"] == [("", 121.0)]
            assert get(f"http://{host}:{port}/nope")[0] == 404
        finally:
            server.stop()
        with pytest.raises(OSError):
            socket.create_connection((host, port), timeout=2).close()


    def test_render_error_is_a_500(self, tmp_path: Path) -> None:
        """A failure while rendering answers 500 with the error, and the server keeps serving."""
        def broken() -> Status:
            raise RuntimeError("boom")

        server = MetricsServer("127.0.0.1", 0, broken).start()
        try:
            host, port = server.address
            for _ in range(2):
                code, _, body = get(f"http://{host}:{port}/metrics")
                assert code == 500 and "boom" in body
        finally:
            server.stop()
