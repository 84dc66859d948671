"""Prometheus text metrics rendered from `Status`, served on GET /metrics by a stdlib HTTP server thread.

`render_metrics` is pure. The server only reads the live `Status` (through a callable) and never touches
the event loop, so a slow scrape cannot delay supervision or the sd_notify watchdog. It listens on
loopback unless `[metrics] listen` names another address literally (e.g. "0.0.0.0:9400").
"""
from __future__ import annotations

import copy
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from supervisor import __version__
from supervisor.config import Config
from supervisor.errors import ConfigError
from supervisor.host.log import Log
from supervisor.policy.state import State, Status

__all__ = [
    "CONTENT_TYPE",
    "RESTART_LATENCY_BUCKETS",
    "render_metrics",
    "parse_listen",
    "listen_address",
    "is_loopback",
    "MetricsServer",
    "start_metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "fsdp_supervisor_"
# Restart latency (failure seen -> training again) spans a fast in-place restart to a long backoff.
RESTART_LATENCY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float | int | bool) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


class _Doc:
    """Collects metric families; a family whose value is unknown (None) is left out, as Prometheus expects."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, object], Any]]) -> None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return
        self.lines += [f"# HELP {_P}{name} {help_}", f"# TYPE {_P}{name} {kind}"]
        for labels, v in samples:
            lab = ",".join(f'{k}="{_label(x)}"' for k, x in labels.items())
            self.lines.append(f"{_P}{name}{{{lab}}} {_num(v)}" if lab else f"{_P}{name} {_num(v)}")

    def gauge(self, name: str, help_: str, value: Any, **labels: object) -> None:
        self.family(name, "gauge", help_, [(labels, value)])

    def histogram(self, name: str, help_: str, values: list[float], buckets: tuple[float, ...]) -> None:
        """Cumulative `_bucket{le}` counts, then `_sum` and `_count` (always exported, zero without samples)."""
        self.lines += [f"# HELP {_P}{name} {help_}", f"# TYPE {_P}{name} histogram"]
        for le in buckets:
            self.lines.append(f'{_P}{name}_bucket{{le="{le:g}"}} {sum(1 for v in values if v <= le)}')
        self.lines.append(f'{_P}{name}_bucket{{le="+Inf"}} {len(values)}')
        self.lines += [f"{_P}{name}_sum {_num(float(sum(values)))}", f"{_P}{name}_count {len(values)}"]


def render_metrics(st: Status, *, now: float) -> str:
    """The Prometheus text exposition (format 0.0.4) of one status snapshot."""
    d = _Doc()
    d.gauge("build_info", "Version of the supervisor.", 1, version=__version__)
    d.family("state", "gauge", "Supervisor state (1 for the current one).",
             [({"state": s.value}, int(st.state is s)) for s in State])
    d.gauge("start_time_seconds", "Unix time the supervisor started.", st.started_at or None)
    d.family("restarts_total", "counter", "Job relaunches after a failure, carried across supervisor restarts.",
             [({}, st.restarts)])
    d.family("rollbacks_total", "counter", "Divergences rolled back, carried across supervisor restarts.",
             [({}, st.rollbacks)])
    d.gauge("attempt", "Number of the current (or last) job attempt.", st.attempt)
    d.gauge("job_step", "Training step from the job's heartbeat.", st.step)
    d.gauge("job_step_timestamp_seconds", "Unix time the heartbeat step last advanced.", st.step_at)
    d.gauge("job_steps_per_second", "Training steps per second over the attempt's last 30 s of steps.", st.rate_steps_per_s)
    d.gauge("job_loss", "Loss from the job's heartbeat.", st.loss)
    d.gauge("job_val_loss", "The last evaluation loss from the job's heartbeat.", st.val_loss)
    d.gauge("goodput", "Productive training time over supervisor wall time, 0-1, from the run's history.",
            st.goodput)
    d.histogram("restart_latency_seconds", "Per recovery: seconds from a failure seen to the job training again.",
                st.restart_latency_s, RESTART_LATENCY_BUCKETS)
    d.family("steps_lost_total", "counter", "Training steps redone after failures (step at failure - step resumed).",
             [({}, st.steps_lost_total)])
    d.family("time_lost_seconds_total", "counter",
             "Seconds lost to failures, by phase: detection, stop, relaunch, worker_start, load, redo.",
             [({"phase": k}, float(v)) for k, v in sorted(st.time_lost_s.items())])
    ranks = [r for r in st.ranks if isinstance(r.get("rank"), int)]
    d.family("rank_step", "gauge", "Training step of each watched rank (its own heartbeat).",
             [({"rank": r["rank"]}, r.get("step")) for r in ranks])
    d.family("rank_step_seconds", "gauge", "Each rank's own time per step (smoothed), as its heartbeat reports it.",
             [({"rank": r["rank"]}, r.get("step_s")) for r in ranks])
    d.family("rank_straggler", "gauge", "1 while a rank is flagged as a straggler.",
             [({"rank": r["rank"]}, bool(r.get("straggler"))) for r in ranks])
    d.gauge("stragglers", "Ranks flagged as stragglers now.", len(st.stragglers) if ranks else None)
    hang = st.last_hang or {}
    hung = ",".join(str(r.get("rank")) for r in hang.get("ranks") or [] if isinstance(r, dict))
    d.gauge("last_hang_timestamp_seconds", "Unix time of the last hang detected, labelled with the ranks named.",
            hang.get("at"), ranks=hung)
    ck = st.latest_checkpoint or {}
    d.gauge("last_checkpoint_step", "Step of the newest complete checkpoint.", ck.get("step"))
    mtime = ck.get("mtime")
    d.gauge("last_checkpoint_timestamp_seconds", "Unix time the newest complete checkpoint was written.", mtime)
    d.gauge("last_checkpoint_age_seconds", "Seconds since the newest complete checkpoint was written.",
            None if mtime is None else max(0.0, now - float(mtime)))
    d.gauge("checkpoint_bytes", "Bytes in complete checkpoints under the checkpoint root.", st.checkpoint_bytes)
    d.gauge("quarantined_checkpoints", "Checkpoints quarantined after repeated failures.", len(st.quarantined))
    d.gauge("disk_free_bytes", "Free bytes on the checkpoint file system.", st.disk_free_bytes)
    ex = st.last_exit
    if ex is not None:
        d.gauge("last_exit_timestamp_seconds", "Unix time of the last job exit, labelled with its classification.",
                ex.at, reason=ex.reason, code="" if ex.code is None else ex.code, signal=ex.signal or "")
    d.gauge("updated_timestamp_seconds", "Unix time the status last changed.", st.updated_at or None)
    return "\n".join(d.lines) + "\n"


def parse_listen(listen: str) -> tuple[str, int]:
    """`[metrics] listen` -> (host, port). "PORT" or ":PORT" mean loopback; a host must be an IP literal."""
    text = listen.strip()
    host, sep, port_s = text.rpartition(":")
    if not sep:
        host, port_s = "", text
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host in ("", "localhost"):
        host = "127.0.0.1"
    bad = f'[metrics] listen {listen!r}: expected "HOST:PORT" with an IP address (e.g. "127.0.0.1:9400")'
    try:
        ipaddress.ip_address(host)  # a literal only: a name could resolve to a public address behind our back
        port = int(port_s)
    except ValueError:
        raise ConfigError(bad) from None
    if not 0 <= port <= 65535:
        raise ConfigError(bad)
    return host, port


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


class MetricsServer:
    """GET /metrics on (host, port) from a daemon thread; `port` 0 picks a free one (see `address`)."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], Status],
                 clock: Callable[[], float] = time.time) -> None:
        self.snapshot, self.clock = snapshot, clock
        from supervisor.observe.metrics_http import Server  # only here: most jobs scrape nothing

        self.httpd = Server((host, port), socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.httpd.render, self.httpd.content_type = self.render, CONTENT_TYPE
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def render(self) -> str:
        st = copy.copy(self.snapshot())  # the main thread replaces fields; work on one consistent-enough view
        return render_metrics(st, now=self.clock())

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def listen_address(cfg: Config) -> tuple[str, int] | None:
    """(host, port) from `[metrics] listen`, None when unset; ConfigError naming the file and key."""
    if not cfg.metrics.listen:
        return None
    try:
        return parse_listen(cfg.metrics.listen)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: {exc}") from None


def start_metrics(cfg: Config, snapshot: Callable[[], Status], log: Log) -> MetricsServer | None:
    """Start the endpoint configured by `[metrics] listen` (unset: off); a bad address or busy port is a ConfigError."""
    address = listen_address(cfg)
    if address is None:
        return None
    host, port = address
    listen = cfg.metrics.listen
    try:
        server = MetricsServer(host, port, snapshot).start()
    except OSError as exc:
        raise ConfigError(f"{cfg.path}: [metrics] listen {listen!r}: cannot listen: {exc.strerror or exc}") from None
    host, port = server.address
    if is_loopback(host):
        log.info("metrics_listening", url=f"http://{_url_host(host)}:{port}/metrics")
    else:
        log.warning("metrics_listening", url=f"http://{_url_host(host)}:{port}/metrics", exposed=True)
    return server


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
