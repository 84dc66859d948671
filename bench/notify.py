"""Alert latency: a run's event -> its webhook's receipt, on loopback (issue 37).

A real `fsdp-supervisor run` of a job that fails at once, `[restart] max_no_progress_restarts = 3`: its crash loop
and its give-up are two default alerts, POSTed to a `http.server` on 127.0.0.1. Each alert's JSON carries `at`, the
supervisor's clock when the event was published; the server notes its own clock when the POST arrives (one host, one
clock).
`latency_s` is the median over every alert of every round, `latency_s_max` the slowest.

    python -m bench.notify        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.common import PY, REPO, Tagged, job_env, median, scratch

__all__ = ["run", "measure_once"]

TIMEOUT = 120.0
JOB = [PY, "-c", "import sys, time; time.sleep(0.3); sys.exit(1)"]


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        got = time.time()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.received.put((got, body))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def measure_once() -> list[dict[str, Any]]:
    """One supervised run to its give-up: each alert's kind and latency."""
    srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    srv.received, srv.daemon_threads = queue.Queue(), True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    root = scratch("notify")
    tagged = Tagged()
    try:
        config = root / "job.toml"
        config.write_text(f"[job]\ncommand = {json.dumps(JOB)}\ncwd = {json.dumps(str(REPO))}\n\n"
                          f"[checkpoints]\ndir = {json.dumps(str(root / 'ckpts'))}\n\n"
                          "[restart]\nmax_no_progress_restarts = 3\nbackoff_initial_s = 0.1\nbackoff_jitter = 0\n\n"
                          f'[notify]\nwebhook = "http://127.0.0.1:{srv.server_port}/hook"\nmin_interval_s = 0\n')
        sup = tagged.start([PY, "-m", "supervisor", "run", "-c", str(config)], log=root / "supervisor.out",
                           env=job_env(), cwd=root)
        sup.wait(timeout=TIMEOUT)
        out = []
        while not srv.received.empty():
            got, body = srv.received.get_nowait()
            alert = json.loads(body)
            out.append({"event": alert["event"], "latency_s": round(got - alert["at"], 4)})
        return out
    finally:
        tagged.close()
        srv.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def run(repeats: int = 3) -> dict[str, Any]:
    """`notify.latency_s` (median over every alert), `latency_s_max`, and what was sent."""
    alerts = [a for _ in range(repeats) for a in measure_once()]
    lat = [a["latency_s"] for a in alerts]
    return {"latency_s": median(lat, 4), "latency_s_max": max(lat, default=None), "alerts": len(alerts),
            "events": sorted({a["event"] for a in alerts}), "repeats": repeats}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(), indent=2))
