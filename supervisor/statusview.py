"""Human renderings of `Status`: the `status` summary and the one-line form used for sd_notify STATUS=."""
from __future__ import annotations

from supervisor.humanize import human_age, human_bytes
from supervisor.state import State, Status

__all__ = ["render_status", "one_line"]


def one_line(st: Status) -> str:
    """State, step, last checkpoint, restarts: short enough for `systemctl status`."""
    parts = [st.state.value]
    if st.attempt:
        parts.append(f"attempt {st.attempt}")
    if st.step is not None:
        rate = f" ({st.rate_steps_per_s:.2f} step/s)" if st.rate_steps_per_s else ""
        parts.append(f"step {st.step}{rate}")
    ck = st.latest_checkpoint
    parts.append(f"ckpt step {ck.get('step')}" if ck else "no checkpoint")
    parts.append(f"restarts {st.restarts}")
    if st.last_exit is not None and st.state is not State.RUNNING:
        parts.append(f"last exit {st.last_exit.reason}")
    return ", ".join(parts)


def render_status(st: Status, *, running: bool, now: float) -> str:
    rows: list[tuple[str, str]] = []
    state = st.state.value if running or st.state.final else f"{st.state.value} (supervisor not running: stale state)"
    rows.append(("state", state))
    if st.reason:
        rows.append(("reason", st.reason))
    rows.append(("supervisor", f"pid {st.pid}, up {human_age(now - st.started_at)}" if running else "not running"))
    if st.job_pid:
        rows.append(("job", f"pid {st.job_pid}, attempt {st.attempt}"))
    if st.step is not None:
        rate = f", {st.rate_steps_per_s:.2f} step/s" if st.rate_steps_per_s else ""
        age = f", {human_age(now - st.step_at)} ago" if st.step_at else ""
        rows.append(("step", f"{st.step} ({st.phase or '?'}{rate}{age})"))
    ck = st.latest_checkpoint
    if ck:
        age = f", {human_age(now - ck['mtime'])} old" if ck.get("mtime") else ""
        rows.append(("last checkpoint", f"step {ck.get('step')} {ck.get('path')}{age}"))
    else:
        rows.append(("last checkpoint", "none"))
    if st.resumed_from:
        rows.append(("resumed from", st.resumed_from))
    ex = st.last_exit
    last = f", last exit: {ex.reason} (code {ex.code}, signal {ex.signal})" if ex else ""
    if ex and ex.detail:
        last += f" {ex.detail}"
    rows.append(("restarts", f"{st.restarts}{last}"))
    if st.next_launch_at and st.state is State.BACKOFF:
        rows.append(("next launch", f"in {human_age(st.next_launch_at - now)}"))
    if st.quarantined:
        rows.append(("quarantined", ", ".join(st.quarantined)))
    rows.append(("free disk", human_bytes(st.disk_free_bytes)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:>{width}}: {v}" for k, v in rows)
