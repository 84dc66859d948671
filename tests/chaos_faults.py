"""The faults of the chaos tier. Each waits for its moment, strikes, waits for the supervisor's relaunch and
checks the outcome that is specific to it; run-wide invariants are the `Monitor`'s job (tests/chaos.py).
Every fault ends one job attempt (a relaunch costs the most CPU), so the torn checkpoint rides on the hang.

A fault returns a one-line note of what it did (printed with the seed). `plan(rng)` draws one of each kind in a
seeded random order with seeded parameters.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.checkpoints import FOREIGN, TORN, scan, verify
from supervisor.checkpoints.naming import is_temporary, name_step
from supervisor.layout import MANIFEST_NAME, TRASH_SUFFIX, sidecar_name
from tests.chaos import SAVE_EVERY, ChaosRun
from tests.helpers import wait_for

__all__ = ["Fault", "plan", "prepare_planted", "assert_no_incomplete_final_dirs", "take_over", "kill_at_random_moment",
           "kill_during_save", "kill_supervisor_mid_retention", "strike", "PLANTED", "PAD_FILES"]

PLANTED = "step_00000001"  # an old complete checkpoint retention will delete (slowly: it carries PAD_FILES)
PAD_FILES = 4000


@dataclass
class Fault:
    name: str
    strike: Callable[..., str]
    params: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.params.items())})"

    def __call__(self, c: ChaosRun) -> str:
        return self.strike(c, **self.params)


def _target(c: ChaosRun, victim: str) -> psutil.Process:
    """The torchrun agent ("agent") or the worker of a rank ("rank0", "rank1") of the running attempt."""
    if victim == "agent":
        return wait_for(c.dirs.job, 30, "the torchrun agent")  # type: ignore[return-value]
    rank = int(victim.removeprefix("rank"))
    return wait_for(lambda: c.dirs.worker(rank), 30, f"the worker of rank {rank}")  # type: ignore[return-value]


def _last_exit(st: dict[str, Any]) -> dict[str, Any]:
    return st.get("last_exit") or {}


def kill_at_random_moment(c: ChaosRun, victim: str, min_steps: int) -> str:
    """SIGKILL a worker or the agent once this attempt has trained `min_steps` past its resume point."""
    attempt = c.attempt()
    step = c.wait_training(min_steps)
    _target(c, victim).kill()
    st = c.wait_relaunch(attempt)
    assert _last_exit(st).get("reason") == "signal", st
    return f"SIGKILL {victim} at step ~{step}; relaunched from {st['resumed_from']}"


def kill_during_save(c: ChaosRun, victim: str, delay_s: float) -> str:
    """SIGKILL a worker or the agent `delay_s` after a save's temporary dir appears, while it still exists."""
    attempt = c.attempt()
    c.wait_training(1)
    # A save that commits within the delay does not count: take the next one, with half the delay (on a quiet
    # machine a small save can be shorter than the seed's delay every time).
    for attempt_no in range(8):
        seen = set(c.dirs.tmp_dirs())
        tmp = wait_for(lambda: [t for t in c.dirs.tmp_dirs() if t not in seen], 120, "a save in flight",  # noqa: B023
                       interval=0.005)[0]  # type: ignore[index]
        victim_proc = _target(c, victim)
        time.sleep(delay_s / 2 ** attempt_no)
        if tmp.exists():
            victim_proc.kill()
            delay_s /= 2 ** attempt_no
            break
    else:
        raise AssertionError("no save could be caught in flight")
    st = c.wait_relaunch(attempt)
    step = name_step(tmp.name)
    final = c.dirs.root / f"step_{step:08d}"  # committed after all, or never; the one torn on purpose may remain
    assert final.name in c.torn or not final.exists() or verify(final).complete, verify(final)
    return f"SIGKILL {victim} {delay_s:.2f}s into the save of step {step} ({tmp.name}); resumed from {st['resumed_from']}"


def hang_with_torn_newest(c: ChaosRun, rank: int, min_steps: int) -> str:
    """SIGSTOP a worker, and while the job is frozen truncate a shard of the newest checkpoint: the supervisor
    must call it a hang, replace the job, and resume from the checkpoint before the torn one."""
    attempt = c.attempt()
    if c.dirs.newest_step() < 2 * SAVE_EVERY:  # two complete checkpoints: one to tear, one to fall back to
        c.wait_commit(above=2 * SAVE_EVERY - 1)
    step = c.wait_training(min_steps)
    victim = _target(c, f"rank{rank}")
    beat = c.dirs.run_dir / "heartbeats" / f"rank-{rank}.json"
    for _ in range(200):  # a hang in training: one inside a save rightly gets save_timeout_s, not hang_timeout_s
        victim.suspend()
        try:
            if json.loads(beat.read_text()).get("phase") in (None, "train"):
                break
        except (OSError, ValueError):
            break
        victim.resume()
        time.sleep(0.02)
    try:
        time.sleep(1.0)  # a commit rank 0 had already begun finishes; after that nothing can commit
        ckpt = c.dirs.root / f"step_{c.dirs.newest_step():08d}"
        shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)

        def damage() -> None:
            with open(shard, "r+b") as f:
                f.truncate(shard.stat().st_size // 2)

        fallback = c.monitor.tear(damage)
        c.torn.add(ckpt.name)
        assert verify(ckpt).state == TORN, verify(ckpt)
        assert fallback is not None and fallback < (name_step(ckpt.name) or 0)
        st = c.wait_relaunch(attempt)
    finally:
        with contextlib.suppress(psutil.Error):
            victim.resume()
    assert _last_exit(st).get("reason") == "hang", st
    assert st["resumed_from"] == str(c.dirs.root / f"step_{fallback:08d}"), st
    return f"SIGSTOP rank {rank} at step ~{step}, truncated {shard.name} of {ckpt.name}; hang detected, " \
           f"resumed from step {fallback}"


def prepare_planted(stage: Path, reference_ckpts: Path) -> Path:
    """An old complete checkpoint (a manifest-less copy of a real one) with many small files, built off-root."""
    planted = stage / PLANTED
    shutil.copytree(reference_ckpts / "step_00000005", planted)
    (planted / MANIFEST_NAME).unlink()  # its step then comes from the name: 1, the oldest of all
    pad = planted / "pad"
    pad.mkdir()
    for i in range(PAD_FILES):
        (pad / f"{i:05d}").write_bytes(b"x")
    assert verify(planted).complete
    return planted


def kill_supervisor_mid_retention(c: ChaosRun, planted: Path, while_orphaned: Callable[[], str] | None = None) -> str:
    """Plant an old checkpoint retention must delete, SIGKILL the supervisor while it is removing it, start a
    new supervisor: the orphaned job is stopped before anything launches and the trash is cleared.
    `while_orphaned` runs between the kill and the new supervisor (a second config tried meanwhile)."""
    attempt = c.attempt()
    c.wait_training(1)
    os.rename(planted, c.dirs.root / PLANTED)
    trash = c.dirs.root.parent / sidecar_name(c.dirs.root.name, TRASH_SUFFIX)  # next to the root, never inside
    parked = wait_for(lambda: list(trash.glob(f"{PLANTED}.*")) if trash.is_dir() else None, 120,
                      "retention to start deleting the planted checkpoint", interval=0.002)[0]  # type: ignore[index]
    assert c.proc is not None
    c.proc.kill()
    c.proc.wait(30)
    assert parked.exists(), "the supervisor finished the delete before it was killed: nothing was tested"
    assert not (c.dirs.root / PLANTED).exists()
    assert_no_incomplete_final_dirs(c)
    st, agent, also = take_over(c, attempt, while_orphaned)
    wait_for(lambda: not any(trash.iterdir()), 60, "trash leftovers cleared by the new supervisor")
    return f"SIGKILL supervisor while removing {parked.name}; {also}new supervisor stopped orphan {agent}, " \
           f"resumed from {st['resumed_from']}"


def take_over(c: ChaosRun, attempt: int, while_orphaned: Callable[[], str] | None = None) -> tuple[dict[str, Any], int, str]:
    """After the supervisor was SIGKILLed: its job runs on; a new supervisor on the same config stops that orphan
    before it launches attempt `attempt` + 1. Returns (state at the relaunch, the orphan's pid, what
    `while_orphaned` said)."""
    agent = c.dirs.job()
    assert agent is not None, "the job should have survived its supervisor"
    orphans = [agent, *agent.children(recursive=True)]
    also = f"{while_orphaned()}; " if while_orphaned is not None else ""
    c.start_supervisor()
    st = c.wait_relaunch(attempt)
    assert not [p.pid for p in orphans if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    stopped = c.dirs.events("orphan_job_stopped")
    assert stopped and stopped[-1]["job_pid"] == agent.pid, stopped
    return st, agent.pid, also


def assert_no_incomplete_final_dirs(c: ChaosRun) -> None:
    """No checkpoint under a final name is incomplete, except one a fault tore on purpose (until re-saved); what
    is not a checkpoint (a backup copy, TensorBoard logs) is foreign, neither."""
    for info in scan(c.dirs.root):
        if is_temporary(info.name) or info.name in c.torn or info.state == FOREIGN:
            continue
        assert info.complete, f"{info.name} looks like a checkpoint but is {info.state}: {info.reason}"


def strike(c: ChaosRun, events: Sequence[tuple[str, Callable[[Any], str]]],
           before_the_end: Callable[[], None] | None = None) -> tuple[int, str]:
    """Start the supervisor, strike each event in order and wait for the run's end: (exit code, output tail).
    The monitor samples throughout; after each event no checkpoint under a final name is incomplete and no
    process of the test lives outside the supervisor's tree."""
    started = time.monotonic()
    c.monitor.start()
    try:
        c.start_supervisor()
        c.wait_running(1)
        for name, event in events:
            t0 = time.monotonic()
            c.say(f"{name}: {event(c)} [{time.monotonic() - t0:.1f}s]")
            assert_no_incomplete_final_dirs(c)
            assert c.strays() == [], f"processes outside the supervisor's tree after {name}"
        if before_the_end is not None:
            before_the_end()
        rc, out = c.finish()
    finally:
        c.monitor.stop()
    c.say(f"finished in {time.monotonic() - started:.1f}s, {c.attempt()} attempts")
    return rc, out


def plan(rng: random.Random, planted: Path) -> list[Fault]:
    """One fault of each kind, seeded parameters, seeded order."""
    faults = [
        Fault("kill", kill_at_random_moment, {"victim": rng.choice(["rank0", "rank1", "agent"]),
                                              "min_steps": rng.randint(1, 3)}),
        Fault("kill_during_save", kill_during_save, {"victim": rng.choice(["rank0", "rank1", "agent"]),
                                                     "delay_s": round(rng.uniform(0.0, 0.2), 3)}),
        Fault("hang_with_torn_newest", hang_with_torn_newest, {"rank": rng.choice([0, 1]),
                                                               "min_steps": rng.randint(1, 3)}),
        Fault("kill_supervisor_mid_retention", kill_supervisor_mid_retention, {"planted": planted}),
    ]
    rng.shuffle(faults)
    return faults


