"""The report page: one self-contained HTML file (inline SVG and CSS, no script, nothing fetched).

What it draws: docs/history.md (the top). The page forbids scripts and remote content (a Content-Security-Policy
meta tag), and every string from the history is escaped: it is meant to be attached to a bug report.
"""
from __future__ import annotations

import time

from supervisor.history.fold import Fold
from supervisor.history.losses import LOSS_PARTS, Loss
from supervisor.history.svg import Linear, esc, fmt_num, fmt_time, nice_ticks, polyline, svg, tag, text, time_ticks
from supervisor.history.views import AttemptView, Summary
from supervisor.observe.humanize import checkpoint_label, human_age

__all__ = ["render_html", "REASON_COLORS"]

WIDTH = 1120
LEFT, RIGHT = 64, 14
MAX_TABLE_ROWS = 200
REASON_COLORS = {
    "completed": "#2e7d32", "stopped": "#78909c", "crash": "#c62828", "signal": "#ef6c00", "oom": "#6a1b9a",
    "hang": "#8d6e63", "corrupt": "#ad1457", "running": "#64b5f6", "unknown": "#bdbdbd",
}
_CSS = """
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:14px 22px;color:#222;background:#fff}
h1{font-size:18px;margin:0}h2{font-size:14px;margin:12px 0 2px}p{margin:2px 0}.meta{color:#555}
table{border-collapse:collapse;margin-top:4px}td,th{padding:2px 9px 2px 0;text-align:left;vertical-align:top}
table.attempts td,table.attempts th{border-bottom:1px solid #eee}table.summary th{font-weight:normal;color:#555}
table.summary td{font-weight:600;padding-right:22px}.detail{max-width:460px;overflow-wrap:anywhere;color:#444}
svg{display:block}svg text{font-size:11px;fill:#555}.axis{stroke:#aaa}.grid{stroke:#eee}
.session{fill:#f2f5f9}.attempt{stroke:#fff;stroke-width:.5}.commit{stroke:#1b5e20;stroke-width:1.5}
.quarantine{fill:#b71c1c}.deletion{stroke:#bbb}.restart{stroke:#c62828;stroke-width:1.2;stroke-dasharray:4 3}
.recovery{stroke:#c62828;stroke-width:2}.failure{fill:#c62828}.diverged{stroke:#6a1b9a;stroke-width:1.5}
.loss{fill:none;stroke:#1565c0;stroke-width:1.6}.loss.lost{stroke:#9aa9b4;stroke-dasharray:3 3}
polyline.val-loss{fill:none;stroke:#ef6c00;stroke-width:1.2}circle.val-loss{fill:#ef6c00}
.hang{fill:#8d6e63}.rate{fill:none;stroke:#37474f;stroke-width:1.3}
.legend{color:#444;margin:2px 0}.legend span{margin-right:14px}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
.legend i.line{height:2px;vertical-align:3px}
""" + "".join(f".reason-{k}{{fill:{c}}}i.reason-{k}{{background:{c}}}" for k, c in REASON_COLORS.items())


def _reason(a: AttemptView, running: bool) -> str:
    """How the attempt ended, as written (the timeline colours it only if it is a reason we know)."""
    if a.reason is None:
        return "running" if running else "unknown"
    return a.reason


def _colour(reason: str) -> str:
    return reason if reason in REASON_COLORS else "unknown"


def _end(a: AttemptView, fold: Fold, t1: float) -> float:
    if a.ended is not None:
        return a.ended
    return t1 if fold.running and a is fold.attempts[-1] else a.last_t


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _y_axis(body: list[str], lo: float, hi: float, y: Linear, x0: float, x1: float) -> None:
    for v in nice_ticks(lo, hi, 4):
        yy = y(v)
        body.append(tag("line", "grid", x1=float(x0), y1=yy, x2=float(x1), y2=yy))
        body.append(text(x0 - 6, yy + 4, fmt_num(v), anchor="end"))


def _time_axis(body: list[str], x: Linear, t0: float, t1: float, y: float) -> None:
    body.append(tag("line", "axis", x1=float(LEFT), y1=y, x2=float(WIDTH - RIGHT), y2=y))
    for t in time_ticks(t0, t1):
        body.append(tag("line", "axis", x1=x(t), y1=y, x2=x(t), y2=y + 4))
        body.append(text(x(t), y + 15, fmt_time(t, t1 - t0), anchor="middle"))


def _timeline(fold: Fold, t0: float, t1: float) -> str:
    x = Linear(t0, t1, LEFT, WIDTH - RIGHT)
    body = [text(LEFT - 6, 31, "attempts", anchor="end"), text(LEFT - 6, 61, "events", anchor="end")]
    for start, end in fold.sessions:
        body.append(tag("rect", "session", x=x(start), y=8.0, width=max(1.0, x(end) - x(start)), height=62.0))
    failed_at: float | None = None
    for a in fold.attempts:
        reason = _reason(a, fold.running)
        end = _end(a, fold, t1)
        what = f"attempt {a.number}: {reason}" + (f" (code {a.code})" if a.code is not None else "") + (
            f" {a.signal}" if a.signal else "")
        tip = "\n".join(filter(None, [what, f"{_utc(a.started)}, ran {human_age(end - a.started)}",
                                      f"resumed from step {a.resumed_step}" if a.resumed_step is not None else None,
                                      f"max step {a.max_step}" if a.max_step is not None else None, a.detail]))
        body.append(tag("rect", f"attempt reason-{_colour(reason)}", tip, x=x(a.started), y=14.0,
                        width=max(2.0, x(end) - x(a.started)), height=28.0))
        if a.first_step_at is not None and failed_at is not None:
            body.append(tag("line", "recovery", f"recovered in {a.first_step_at - failed_at:.1f} s",
                            x1=x(failed_at), y1=46.0, x2=max(x(a.first_step_at), x(failed_at) + 2), y2=46.0))
            failed_at = None
        if a.ended is not None and a.reason not in ("completed", "stopped"):
            body.append(tag("line", "restart", f"attempt {a.number} failed: {reason}", x1=x(a.ended), y1=8.0,
                            x2=x(a.ended), y2=70.0))
            failed_at = a.ended if failed_at is None else failed_at
    drawn: set[tuple[str, int]] = set()
    for m in fold.marks:
        mx = x(m.t)
        if (m.kind, int(mx / 2)) in drawn:  # a month of commits: one mark per 2 pixels is all that shows
            continue
        drawn.add((m.kind, int(mx / 2)))
        if m.kind == "checkpoint_committed":
            body.append(tag("line", "commit", f"checkpoint {checkpoint_label(m.step, m.path)}: {m.path}", x1=mx, y1=52.0,
                            x2=mx, y2=68.0))
        elif m.kind == "quarantined":
            why = f": {m.detail}" if m.detail else ""
            body.append(tag("rect", "quarantine", f"quarantined {m.path}{why}", x=mx - 4, y=54.0,
                            width=8.0, height=8.0, transform=f"rotate(45 {mx:.1f} 58)"))
        elif m.kind in ("hang", "diverged", "rolled_back"):  # a divergence (its why), and the rollback to `path`
            what = (f"hang at step {m.step}: {m.detail or 'no rank named'}" + (f"; stacks: {m.path}" if m.path else "")
                    if m.kind == "hang" else f"{m.kind.replace('_', ' ')} at step {m.step}: {m.detail or m.path}")
            body.append(tag("rect", "hang", what, x=mx - 3, y=50.0, width=6.0, height=6.0))
        elif m.kind == "retention_deleted":
            why = f" ({m.detail})" if m.detail else ""
            body.append(tag("line", "deletion", f"deleted {m.path}{why}", x1=mx, y1=64.0, x2=mx, y2=70.0))
    _time_axis(body, x, t0, t1, 74.0)
    return svg(WIDTH, 94, body, "timeline of attempts", "timeline")


def _split_lost(a: AttemptView, resumed: int | None) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(kept, lost) loss points of attempt `a` when the next attempt resumed from step `resumed`; both meet at
    the resume step (interpolated between samples), so the dashed part starts where the work was lost."""
    pts = [(float(s.step), s.loss) for s in a.samples if s.loss is not None]
    if resumed is None:
        return pts, []
    cut = next((i for i, (step, _) in enumerate(pts) if step > resumed), len(pts))
    if cut == len(pts):
        return pts, []
    if cut == 0:
        return [], pts
    (s0, v0), (s1, v1) = pts[cut - 1], pts[cut]
    joint = (float(resumed), v0 + (v1 - v0) * (resumed - s0) / (s1 - s0)) if s1 > s0 else pts[cut - 1]
    return [*pts[:cut], joint], [joint, *pts[cut:]]


def _loss_chart(fold: Fold) -> str:
    losses = [(s.step, s.loss) for a in fold.attempts for s in a.samples if s.loss is not None]
    vals = sorted((s.step, s.val_loss) for a in fold.attempts for s in a.samples if s.val_loss is not None)
    height, top, bottom = 250, 10, 220
    if not losses and not vals:
        return svg(WIDTH, 40, [text(LEFT, 24, "no loss in the history (the job's heartbeat reports none)")],
                   "loss", "loss-chart")
    steps = [p[0] for p in losses + vals]
    ys = [p[1] for p in losses + vals]
    s0, s1, lo, hi = min(steps), max(steps), min(ys), max(ys)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad
    x, y = Linear(s0, s1, LEFT, WIDTH - RIGHT), Linear(lo, hi, bottom, top)
    body: list[str] = []
    _y_axis(body, lo, hi, y, LEFT, WIDTH - RIGHT)
    body.append(tag("line", "axis", x1=float(LEFT), y1=float(bottom), x2=float(WIDTH - RIGHT), y2=float(bottom)))
    for v in nice_ticks(s0, s1, 8):
        body.append(text(x(v), bottom + 15, fmt_num(v), anchor="middle"))
    body.append(text(WIDTH - RIGHT, bottom + 28, "step", anchor="end"))
    resumes: dict[int, list[int]] = {}
    for i, a in enumerate(fold.attempts):
        nxt = fold.attempts[i + 1] if i + 1 < len(fold.attempts) else None
        kept, lost = _split_lost(a, (nxt.resumed_step or 0) if nxt is not None else None)
        if kept:
            body.append(polyline(((x(s), y(v)) for s, v in kept), "loss", f"attempt {a.number}: loss"))
        if lost:
            body.append(polyline(((x(s), y(v)) for s, v in lost), "loss lost",
                                 f"attempt {a.number}: steps redone after it failed"))
        if a.reason not in (None, "completed", "stopped") and (lost or kept):
            s, v = (lost or kept)[-1]
            body.append(tag("circle", "failure", f"attempt {a.number} failed at step {s}: {a.reason}",
                            cx=x(s), cy=y(v), r=3.5))
        if i > 0 and a.resumed_step is not None:
            resumes.setdefault(a.resumed_step, []).append(a.number)
    for step, numbers in resumes.items():  # attempts resuming from one checkpoint share a line
        rx, names = x(step), ",".join(f"#{n}" for n in numbers)
        body.append(tag("line", "restart", f"attempt {names} resumed from step {step}", x1=rx, y1=float(top),
                        x2=rx, y2=float(bottom)))
        body.append(text(rx + 3, top + 10, names))
    for m in fold.marks:  # where a divergence was seen on the step axis (its rollback resumes at a restart line)
        if m.kind == "diverged" and m.step is not None and s0 <= m.step <= s1:
            body.append(tag("line", "diverged", f"diverged at step {m.step}: {m.detail or '?'}", x1=x(m.step),
                            y1=float(top), x2=x(m.step), y2=float(bottom)))
    if vals:
        body.append(polyline(((x(s), y(v)) for s, v in vals), "val-loss", "val_loss"))
        dots = {int(x(s)): (s, v) for s, v in vals}.values()  # one dot per pixel column
        body += [tag("circle", "val-loss", f"val_loss {v:.4g} at step {s}", cx=x(s), cy=y(v), r=2.5) for s, v in dots]
    return svg(WIDTH, height, body, "loss against step", "loss-chart")


def _rate_chart(fold: Fold, t0: float, t1: float) -> str:
    """One line per attempt, labelled with its number: steps per second between samples `window` apart."""
    window = max(1.0, (t1 - t0) / 300)
    lines: list[tuple[int, list[tuple[float, float]]]] = []
    for a in fold.attempts:
        pts, anchor = [], a.samples[0] if a.samples else None
        for s in a.samples[1:]:
            assert anchor is not None
            if s.t - anchor.t >= window:
                if s.step >= anchor.step:
                    pts.append(((s.t + anchor.t) / 2, (s.step - anchor.step) / (s.t - anchor.t)))
                anchor = s
        if pts:
            lines.append((a.number, pts))
    if not lines:
        return svg(WIDTH, 40, [text(LEFT, 24, "no step rate yet (fewer than two heartbeat samples per attempt)")],
                   "step rate", "rate-chart")
    hi = max(r for _, pts in lines for _, r in pts) * 1.1 or 1.0
    bottom = 110.0
    x, y = Linear(t0, t1, LEFT, WIDTH - RIGHT), Linear(0, hi, bottom, 8)
    body: list[str] = []
    _y_axis(body, 0, hi, y, LEFT, WIDTH - RIGHT)
    for number, pts in lines:
        body.append(polyline(((x(t), y(r)) for t, r in pts), "rate", f"attempt {number}: steps per second"))
        body.append(text(x(pts[0][0]) + 2, 18, f"#{number}"))
    _time_axis(body, x, t0, t1, bottom)
    body.append(text(LEFT - 6, 8, "step/s", anchor="end"))
    return svg(WIDTH, 130, body, "step rate over time, one line per attempt", "rate-chart")


def _values(values: list[float] | list[int], unit: str) -> str:
    """A few values as a list, many as count, median and max."""
    if len(values) <= 5:
        return ", ".join(f"{v:g}{unit}" for v in values) or "none"
    ordered = sorted(values)
    return f"{len(values)}: median {ordered[len(values) // 2]:g}{unit}, max {ordered[-1]:g}{unit}"


def _summary_table(s: Summary, on_disk: int | None, saved: int | None = None) -> str:
    """Times that only beats measure are `unknown` for a job without them; its last step is its checkpoints'."""
    span = (lambda v: "unknown") if s.last_step is None else human_age
    lat = _values([round(v, 1) for v in s.restart_latency_s], " s")
    lost = _values(s.steps_lost, "")
    lost += f" ({s.steps_lost_total} in all)" if len(s.steps_lost) > 1 or s.steps_lost_total > sum(s.steps_lost) else ""
    kept = "" if on_disk is None else f", {on_disk} on disk"
    cells = [
        ("goodput", "unknown (no steps reported)" if s.goodput is None else f"{s.goodput:.1%}"),
        ("wall", human_age(s.wall_s)), ("productive", span(s.productive_s)),
        ("start-up", span(s.startup_s)),
        ("checkpoint overhead", "unknown" if s.last_step is None else f"{s.checkpoint_overhead_s:.1f} s"),
        ("restarts", span(s.restart_s)), ("lost (redone)", span(s.lost_s)), ("other", span(s.other_s)),
        ("attempts", str(s.attempts)), ("failures", str(s.failures)),
        ("restart latency", lat), ("steps lost", lost),
        ("time lost", "unknown" if s.last_step is None else _time_lost(s.time_lost_s)),
        ("checkpoints", f"{s.checkpoints_committed} committed{kept}"), ("quarantined", str(s.quarantines)),
        ("corrupt", str(s.corrupt)),
        ("exits", ", ".join(f"{k} {v}" for k, v in sorted(s.exit_reasons.items())) or "none"),
        ("last step", str(s.last_step) if s.last_step is not None else "unknown" if saved is None
         else f"{saved} (the newest checkpoint's)"),
    ]
    rows = ("<tr>" + "".join(f"<th>{esc(k)}</th><td>{esc(v)}</td>" for k, v in cells[i:i + 4]) + "</tr>"
            for i in range(0, len(cells), 4))
    return '<table class="summary">' + "".join(rows) + "</table>"


def _time_lost(parts: dict[str, float]) -> str:
    total = sum(parts.values())
    if total <= 0:
        return "none"
    top = sorted(((v, k) for k, v in parts.items() if v > 0), reverse=True)[:2]
    return f"{total:.1f} s (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for v, k in top) + ")"


def _losses_table(losses: list[Loss], fold: Fold) -> str:
    """One row per failure followed by a relaunch: what it cost, and why (hung ranks, stack dumps)."""
    if not losses:
        return '<p class="meta">No failure was followed by a relaunch.</p>'
    by_number = {a.number: a for a in fold.attempts}
    head = ("<tr><th>attempt</th><th>exit</th><th>hung ranks</th><th>steps reached / resumed / lost</th>"
            + "".join(f"<th>{esc(p.replace('_', ' '))} (s)</th>" for p in LOSS_PARTS) + "<th>stack dumps</th></tr>")
    rows = []
    for x in losses[-MAX_TABLE_ROWS:]:
        a = by_number.get(x.attempt)
        shown = ["?" if v is None else str(v) for v in (x.reached, x.resumed, x.steps_lost)]
        if x.at_least and x.steps_lost is not None:  # the node's heartbeat alone: the job may have gone further
            shown[2] = f"at least {shown[2]}"
        steps = " / ".join(shown)
        cells = "".join(f"<td>{'' if x.seconds.get(p) is None else f'{x.seconds[p]:.1f}'}</td>" for p in LOSS_PARTS)
        rows.append(f"<tr><td>{x.attempt}</td><td>{esc(x.reason)}</td><td>{esc(', '.join(map(str, x.hung_ranks)))}"
                    f"</td><td>{esc(steps)}</td>{cells}<td class=\"detail\">{esc((a.stacks if a else None) or '')}"
                    "</td></tr>")
    return '<table class="attempts">' + head + "".join(rows) + "</table>"


def _stragglers(fold: Fold) -> str:
    if not fold.stragglers:
        return ""
    items = "".join(f"<li>{esc(_utc(m.t))}: {esc(m.detail or '')}</li>" for m in fold.stragglers[-20:])
    return f"<h2>Stragglers</h2><ul>{items}</ul>"


def _legend(fold: Fold) -> str:
    seen = list(dict.fromkeys(_colour(_reason(a, fold.running)) for a in fold.attempts))
    keys = [f'<span><i class="reason-{esc(r)}"></i>{esc(r)}</span>' for r in seen]
    keys += ['<span><i class="line" style="background:#1b5e20"></i>checkpoint</span>',
             '<span><i class="line" style="background:#c62828"></i>failure / time to recover</span>',
             '<span><i style="background:#b71c1c"></i>quarantined</span>',
             '<span><i style="background:#8d6e63"></i>hang detected</span>']
    return '<p class="legend">' + "".join(keys) + "</p>"


def _attempts_table(fold: Fold, t1: float) -> str:
    head = ("<tr><th>#</th><th>started</th><th>ran</th><th>resumed from</th><th>max step</th><th>exit</th>"
            "<th>code / signal</th><th>detail</th></tr>")
    shown = fold.attempts[-MAX_TABLE_ROWS:]
    rows = []
    for a in shown:
        resumed = "fresh start" if a.resumed_from is None else checkpoint_label(a.resumed_step, a.resumed_from)
        code = " / ".join(str(v) for v in (a.code, a.signal) if v is not None)
        rows.append(
            f"<tr><td>{a.number}</td><td>{esc(_utc(a.started))}</td><td>{esc(human_age(_end(a, fold, t1) - a.started))}"
            f"</td><td title=\"{esc(a.resumed_from or '')}\">{esc(resumed)}</td>"
            f"<td>{esc('' if a.max_step is None else a.max_step)}</td><td>{esc(_reason(a, fold.running))}</td>"
            f"<td>{esc(code)}</td><td class=\"detail\">{esc(a.detail or '')}</td></tr>")
    more = len(fold.attempts) - len(shown)
    note = f"<p class=\"meta\">{more} earlier attempts not listed.</p>" if more > 0 else ""
    return note + '<table class="attempts">' + head + "".join(rows) + "</table>"


def render_html(fold: Fold, summary: Summary, *, source: str, generated: float, now: float | None = None,
                on_disk: int | None = None) -> str:
    """The page for a history folded with `Fold(keep=True)`; `now` extends a running session to the present;
    `on_disk`: the complete checkpoints under the root now (beside the commits the history counts)."""
    t0 = fold.first_t if fold.first_t is not None else generated
    t1 = max(fold.last_t or t0, now or 0.0)
    if t1 <= t0:
        t1 = t0 + 1.0
    state = "supervisor running" if fold.running else f"ended: {fold.end_state or 'unknown'}" + (
        f" ({fold.end_reason})" if fold.end_reason else "")
    return "".join([
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>fsdp-supervisor report: {esc(source)}</title><style>{_CSS}</style></head><body>",
        f"<h1>fsdp-supervisor report</h1><p class=\"meta\">{esc(source)}</p>",
        (f"<p class=\"meta\">{esc(_utc(t0))} to {esc(_utc(t1))}, {len(fold.sessions)} supervisor run(s), "
         f"{esc(state)}; generated {esc(_utc(generated))}</p>"),
        _summary_table(summary, on_disk, max((m.step for m in fold.marks if m.kind == "checkpoint_committed"
                                              and m.step is not None), default=None)),
        "<h2>Attempts</h2>", _legend(fold), _timeline(fold, t0, t1),
        "<h2>Loss</h2>",
        ('<p class="legend"><span><i class="line" style="background:#1565c0"></i>loss</span>'
         '<span><i class="line" style="background:#9aa9b4"></i>work lost to a failure</span>'
         '<span><i class="line" style="background:#ef6c00"></i>val_loss</span>'
         '<span><i class="line" style="background:#c62828"></i>restart (resume step)</span></p>'),
        _loss_chart(fold),
        "<h2>Step rate</h2>", _rate_chart(fold, t0, t1),
        "<h2>What failures cost</h2>", _losses_table(summary.losses, fold), _stragglers(fold),
        "<h2>Attempt details</h2>", _attempts_table(fold, t1),
        "</body></html>\n",
    ])
