"""Prometheus rendering from `Status`, the listen address rules, and the /metrics endpoint of a real supervisor."""
from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest

from tests.supervise import FAKEJOB, REPO, Supervisors, cli, stop, supervisors, wait_for, write_config  # noqa: F401
from tests.unit.test_metrics import get, parse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TestLiveSupervisor:
    def test_http_get_against_running_supervisor(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A real supervisor with [metrics] listen serves its state, step and disk figures until it exits."""
        port = free_port()
        job = [sys.executable, str(FAKEJOB), "--steps", "100000", "--step-s", "0.02",
               "--trap-term", str(tmp_path / "t")]
        cfg = write_config(tmp_path, job, f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
        p = supervisors.start(cfg)
        url = f"http://127.0.0.1:{port}/metrics"

        def scraped() -> dict | None:
            try:
                m = parse(get(url)[2])
            except OSError:
                return None
            return m if m.get("fsdp_supervisor_job_step", [("", 0)])[0][1] > 3 else None

        m = wait_for(scraped, 60, "metrics with a step")
        assert ('{state="running"}', 1.0) in m["fsdp_supervisor_state"]
        assert m["fsdp_supervisor_disk_free_bytes"][0][1] > 0 and m["fsdp_supervisor_checkpoint_bytes"] == [("", 0.0)]
        state = json.loads((tmp_path / ".fsdp-supervisor" / "state.json").read_text())
        assert m["fsdp_supervisor_attempt"] == [("", float(state["attempt"]))]
        assert stop(p)[0] == 0
        with pytest.raises(OSError):
            get(url)

    def test_bad_listen_exit_2(self, tmp_path: Path) -> None:
        """A host name in [metrics] listen is exit 2 with one line naming the key; nothing is created."""
        cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB)], '\n[metrics]\nlisten = "example.com:9400"\n')
        r = cli("run", "-c", str(cfg))
        assert r.returncode == 2 and "[metrics] listen" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / ".fsdp-supervisor").exists()

    def test_busy_port_exit_2(self, tmp_path: Path) -> None:
        """A port already in use is exit 2 naming the key, and the job is never launched."""
        marker = tmp_path / "launched"
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            cfg = write_config(tmp_path, [sys.executable, str(FAKEJOB), "--marker", str(marker)],
                               f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
            r = cli("run", "-c", str(cfg))
        assert r.returncode == 2 and "[metrics] listen" in r.stderr and "Traceback" not in r.stderr
        assert not marker.exists()


class TestGrafanaDashboard:
    def test_every_panel_queries_what_a_live_supervisor_exports(self, tmp_path: Path, supervisors: Supervisors,
                                                               make_checkpoint) -> None:  # type: ignore[no-untyped-def]
        """Every metric named in an expr (or a variable query) of deploy/grafana/fsdp-supervisor.json is in a scrape
        of a real supervisor, and every panel uses the ${DS_PROMETHEUS} input."""
        dashboard = json.loads((REPO / "deploy" / "grafana" / "fsdp-supervisor.json").read_text())
        assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        exprs += [v["definition"] for v in dashboard["templating"]["list"]]
        assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dashboard["panels"]) and len(exprs) > 10
        wanted = {name for e in exprs for name in re.findall(r"\bfsdp_supervisor_[a-z0-9_]+", e)}
        make_checkpoint(tmp_path / "ckpts", "step_5")
        port = free_port()
        job = [sys.executable, str(FAKEJOB), "--steps", "100000", "--step-s", "0.02", "--val-every", "5",
               "--trap-term", str(tmp_path / "t")]
        p = supervisors.start(write_config(tmp_path, job, f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'))

        def scraped() -> set[str] | None:
            try:
                names = set(parse(get(f"http://127.0.0.1:{port}/metrics")[2]))
            except OSError:
                return None
            return names if wanted <= names else None

        try:
            wait_for(scraped, 60, "a scrape with every metric the dashboard queries")
        except AssertionError:
            names = set(parse(get(f"http://127.0.0.1:{port}/metrics")[2]))
            raise AssertionError(f"queried but not exported: {sorted(wanted - names)}") from None
        assert stop(p)[0] == 0
