"""A torch-free stand-in job for supervisor tests: beats, sleeps, exits, traps signals, leaks processes."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from marks import append_mark  # tests/jobs/marks.py: this script's directory is on sys.path

from supervisor.contract import ENV_ATTEMPT, ENV_HEARTBEAT, heartbeat_record
from supervisor.host.atomic import write_atomic


def beat(step: int, phase: str = "train", val_loss: float | None = None) -> None:
    path = os.environ.get(ENV_HEARTBEAT)
    if path:
        record = heartbeat_record(step, phase, time=time.time(), loss=1.0 / (step + 1), val_loss=val_loss)
        write_atomic(path, json.dumps(record).encode(), durable=False)


def agent(worker_args: list[str]) -> int:
    worker = subprocess.Popen([sys.executable, __file__, *worker_args], start_new_session=True)

    def on_term(signum: int, _f: object) -> None:
        worker.send_signal(signum)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    return worker.wait()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--val-every", type=int, default=0, help="report a val_loss from this many steps on, updated as often")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--trap-term", default=None, help="on SIGTERM write this file and exit 0")
    p.add_argument("--stop-delay", type=float, default=0.0,
                   help="with --trap-term: take this long to stop (an emergency checkpoint being written)")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--leak", default=None, help="start a detached grandchild that writes its pid here")
    p.add_argument("--marker", default=None, help="append the attempt number and argv here at start")
    p.add_argument("--resume", default=None)
    p.add_argument("--say", action="store_true", help="print a line per step")
    p.add_argument("--frames", type=int, default=0, help="first print this many 100-byte \\r frames (a tqdm bar)")
    p.add_argument("--worker", nargs=argparse.REMAINDER, default=None,
                   help="be an agent: run this script with these args as a worker in its own session; on SIGTERM forward "
                   "it and exit at once, leaving the worker behind (torchrun signalled again while it waits)")
    a = p.parse_args()
    if a.worker is not None:
        return agent(a.worker)
    if a.trap_term:
        def on_term(signum: int, _f: object) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop at a time, like the trainer
            time.sleep(a.stop_delay)
            Path(a.trap_term).write_text(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.marker:  # after the handlers: a test may signal us as soon as it reads this line
        append_mark(a.marker, {"attempt": os.environ.get(ENV_ATTEMPT), "argv": sys.argv[1:],
                               "pid": os.getpid()})
    if a.leak:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                Path(a.leak).write_text(str(os.getpid()))
                time.sleep(600)
            os._exit(0)
        os.wait()
    for i in range(a.frames):
        sys.stdout.write(f"\r{i:>10} |" + "#" * 88)
    if a.frames:
        print(" done", flush=True)
    for step in range(1, a.steps + 1):
        evaluated = a.val_every and step >= a.val_every
        beat(step, val_loss=2.0 / (step // a.val_every * a.val_every + 1) if evaluated else None)
        if a.say:
            print(f"fake step {step}", flush=True)
        time.sleep(a.step_s)
    deadline = time.monotonic() + a.sleep
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return a.exit


if __name__ == "__main__":
    sys.exit(main())
