"""Human renderings of `Status`: the `status` summary and the one-line form used for sd_notify STATUS=."""
from __future__ import annotations

import math
from collections.abc import Sequence

from supervisor.observe.humanize import checkpoint_label, human_age, human_bytes, printable
from supervisor.policy.attempt import REACHED_BY_HEARTBEAT
from supervisor.policy.state import State, Status, output_beyond

__all__ = ["render_status", "one_line", "sparkline", "SPARK_BLOCKS"]

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """One block character per value, lowest ▁ to highest █ (all ▄ when they are equal)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    top = len(SPARK_BLOCKS) - 1
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return SPARK_BLOCKS[top // 2] * len(finite)
    return "".join(SPARK_BLOCKS[min(top, int((v - lo) / (hi - lo) * (top + 1)))] for v in finite)


def _loss_row(st: Status, spark: bool) -> str | None:
    recent = st.loss_recent
    if not recent:
        return None if st.loss is None else f"{st.loss:.4g}"
    text = f"{recent[-1]:.4g}"
    if spark:
        text = f"{sparkline(recent)} {text}"
    else:
        text += f" (last {len(recent)} samples: min {min(recent):.4g}, max {max(recent):.4g})"
    return text + (f", val_loss {st.val_loss:.4g}" if st.val_loss is not None else "")


_PARTS = (("productive_s", "productive"), ("startup_s", "start-up"), ("checkpoint_overhead_s", "checkpoints"),
          ("restart_s", "restarts"), ("lost_s", "lost"), ("other_s", "other"))


def _goodput_rows(st: Status) -> list[tuple[str, str]]:
    """`goodput: 30.0% of 8m05s: productive 2m25s, start-up 41s, ...`, then restart latency and steps lost."""
    parts = st.goodput_parts
    if st.goodput is None:
        return [("goodput", "unknown: the job reports no steps (no heartbeat), so its training time is not known")
                ] if parts else []
    head = f"{st.goodput:.1%}"
    if parts.get("wall_s") is not None:
        spent = ", ".join(f"{label} {human_age(parts[key])}" for key, label in _PARTS if key in parts)
        head += f" of {human_age(parts['wall_s'])}: {spent}"
    more = [*([f"last restart latency {st.restart_latency_s[-1]:.1f}s"] if st.restart_latency_s else []),
            *([f"{sum(st.steps_lost)} steps lost in {len(st.steps_lost)} failure{'s' * (len(st.steps_lost) != 1)}"]
              if st.steps_lost else [])]
    return [("goodput", head), *([("", ", ".join(more))] if more else [])]


_LOSS_PARTS = (("detection", "detection"), ("stop", "stop"), ("relaunch", "relaunch"),
               ("worker_start", "worker start"), ("load", "load"), ("redo", "redo"))


def _failure_row(st: Status) -> str | None:
    """The latest failure's cost: its steps (reached, resumed, lost) and its time by phase."""
    f = st.last_failure
    if not f:
        return None
    lost, reached, resumed = f.get("steps_lost"), f.get("reached"), f.get("resumed")
    text = f"attempt {f.get('attempt')} {f.get('reason')}"
    if f.get("hung_ranks"):
        text += f" (hung: rank {', '.join(map(str, f['hung_ranks']))})"
    if lost is not None and f.get("reached_by") == REACHED_BY_HEARTBEAT:  # the node's beat may lag the job
        text += (f": at least {lost} steps lost (reached {reached} or later: the job writes no per-rank heartbeats;"
                 f" resumed from {resumed})")
    elif lost is not None:
        text += f": {lost} steps lost (reached {reached}, resumed from {resumed})"
    seconds = f.get("time_lost_s") or {}
    known = [(label, seconds[k]) for k, label in _LOSS_PARTS if isinstance(seconds.get(k), (int, float))]
    unknown = [label for k, label in _LOSS_PARTS if k in seconds and seconds[k] is None]  # no beats measured them
    if known:
        total = f"time lost unknown ({', '.join(unknown)} not measured)" if unknown else \
            f"{sum(v for _, v in known):.1f} s lost"
        text += f"; {total}: " + ", ".join(f"{label} {v:.1f}" for label, v in known)
    return text


def _ranks_rows(st: Status) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    ranks = [r for r in st.ranks if isinstance(r.get("step"), int)]
    if ranks:
        steps = [r["step"] for r in ranks]
        span = f"step {steps[0]}" if min(steps) == max(steps) else f"steps {min(steps)}-{max(steps)}"
        if min(steps) != max(steps):
            behind = [str(r["rank"]) for r in ranks if r["step"] == min(steps)]
            span += f" (behind: rank {', '.join(behind[:8])}{', ...' if len(behind) > 8 else ''})"
        rows.append(("ranks", f"{len(ranks)} watched, {span}"))
    slow = [r for r in ranks if r.get("straggler")]
    if slow:
        fast = sorted(r["step_s"] for r in ranks if not r.get("straggler") and isinstance(r.get("step_s"), float))
        median = f", others {fast[len(fast) // 2]:.3g} s" if fast else ""
        rows.append(("stragglers", "; ".join(
            f"rank {r['rank']} {r['step_s']:.3g} s/step" if isinstance(r.get("step_s"), float) else f"rank {r['rank']}"
            for r in slow[:8]) + median))
    if st.hang_detection and st.job_pid:
        rows.append(("hangs", st.hang_detection))
    if st.divergence_guard and st.job_pid:
        rows.append(("divergence", st.divergence_guard))
    hang = st.last_hang
    if hang:
        named = "; ".join(f"rank {r.get('rank')} {r.get('why')}" for r in hang.get("ranks") or []) or "no rank named"
        stacks = f"; stack dumps: {hang['stacks']}" if hang.get("stacks") else ""
        rows.append(("last hang", f"attempt {hang.get('attempt')} at step {hang.get('step')}: {named}{stacks}"))
    return rows


def one_line(st: Status) -> str:
    """State, step, last checkpoint, restarts: short enough for `systemctl status`."""
    parts = [st.state.value]
    if st.attempt:
        parts.append(f"attempt {st.attempt}")
    if st.step is not None:
        rate = f" ({st.rate_steps_per_s:.2f} step/s)" if st.rate_steps_per_s else ""
        parts.append(f"step {st.step}{rate}")
    ck = st.latest_checkpoint
    parts.append(f"ckpt {checkpoint_label(ck.get('step'), ck.get('path'))}" if ck else "no checkpoint")
    parts.append(f"restarts {st.restarts}")
    if st.last_exit is not None and st.state is not State.RUNNING:
        parts.append(f"last exit {st.last_exit.reason}")
    return printable(", ".join(parts))


def render_status(st: Status, *, running: bool, now: float, spark: bool = False) -> str:
    """The `status` table; `spark`: draw the loss sparkline (a terminal that shows Unicode blocks)."""
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
    elif isinstance((st.latest_checkpoint or {}).get("step"), int):  # no heartbeat: the checkpoints say how far
        rows.append(("step", f"{st.latest_checkpoint['step']} (the newest checkpoint's; no heartbeat)"))  # type: ignore[index]
    loss = _loss_row(st, spark)
    if loss is not None:
        rows.append(("loss", loss))
    rows += _ranks_rows(st)
    rows += _goodput_rows(st)
    failure = _failure_row(st)
    if failure is not None:
        rows.append(("last failure", failure))
    ck = st.latest_checkpoint
    if ck:
        age = f", {human_age(now - ck['mtime'])} old" if ck.get("mtime") else ""
        step = f"step {ck['step']} " if ck.get("step") is not None else ""  # validated: int or None
        rows.append(("last checkpoint", f"{step}{ck.get('path')}{age}"))
    else:
        rows.append(("last checkpoint", "none"))
    best = st.best_checkpoint
    if best:
        step = f"step {best['step']} " if best.get("step") is not None else ""
        rows.append(("best checkpoint", f"{step}{best.get('metric')} {best.get('value'):.4g} {best.get('path')}"))
    if st.resumed_from:
        rows.append(("resumed from", st.resumed_from))
    if st.root_idle:
        rows.append(("checkpoints", f"WARNING: {st.root_idle}"))
    if st.local_tier:
        rows.append(("local tier", st.local_tier))
    if st.retention_stopped:
        rows.append(("retention", f"STOPPED, nothing is deleted: {st.retention_stopped}"))
    ex = st.last_exit
    how = ", ".join([*([f"code {ex.code}"] if ex and ex.code is not None else []),
                     *([f"signal {ex.signal}"] if ex and ex.signal else [])])
    last = f", last exit: {ex.reason}" + (f" ({how})" if how else "") if ex else ""
    if ex and ex.detail:
        last += f" {ex.detail}"
    rows.append(("restarts", f"{st.restarts}{last}"))
    if ex:  # the failure's own words, as the job printed them (torchrun's report left out)
        rows += [("last output" if i == 0 else "", line) for i, line in enumerate(output_beyond(ex.detail, ex.last_output))]
    if st.next_launch_at and st.state is State.BACKOFF:
        rows.append(("next launch", f"in {human_age(st.next_launch_at - now)}"))
    if quarantined := [p for p in st.quarantined if p not in st.corrupt]:
        rows.append(("quarantined", ", ".join(quarantined)))
    rows += [("corrupt", f"{len(st.corrupt)}: {', '.join(st.corrupt)}")] if st.corrupt else []  # quarantined too
    if (dv := st.divergence) is not None:
        seen = f"{dv.get('why')} at step {dv.get('onset_step')} (seen at step {dv.get('step')})"
        rows.append(("DIVERGED", f"{seen}, rollbacks {dv.get('rollbacks')}, last good: {dv.get('last_good') or 'none'}"))
    rows.append(("free disk", human_bytes(st.disk_free_bytes)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:>{width}}{':' if k else ' '} {printable(v)}" for k, v in rows)
