"""`status` renderings: the loss sparkline and the goodput row come from `Status`, like every other row."""
from __future__ import annotations

import pytest

from supervisor.observe.statusview import one_line, render_status, sparkline
from supervisor.policy.state import State, Status


@pytest.mark.parametrize(("values", "expected"), [
    ([1, 2, 3, 4, 5, 6, 7, 8], "▁▂▃▄▅▆▇█"),
    ([8.0, 1.0], "█▁"),
    ([2.5, 2.5, 2.5], "▄▄▄"),
    ([], ""),
    ([1.0, float("nan"), 3.0], "▁█"),
])
def test_sparkline(values: list[float], expected: str) -> None:
    """Lowest value ▁, highest █, equal values mid-height, non-finite values left out."""
    assert sparkline(values) == expected


def status() -> Status:
    return Status(state=State.RUNNING, pid=1, attempt=2, step=120, loss=2.0, val_loss=2.25, goodput=0.8731,
                  loss_recent=[4.0, 3.0, 2.5, 2.0], restart_latency_s=[12.34], steps_lost=[7])


def test_goodput_and_loss_rows() -> None:
    """A terminal gets the sparkline; a pipe the same numbers in words; goodput with its latency and loss."""
    tty = render_status(status(), running=True, now=0.0, spark=True)
    assert "loss: █▅▃▁ 2, val_loss 2.25" in tty
    assert "goodput: 87.3%\n                 last restart latency 12.3s, 7 steps lost in 1 failure\n" in tty
    plain = render_status(status(), running=True, now=0.0)
    assert "▁" not in plain and "loss: 2 (last 4 samples: min 2, max 4), val_loss 2.25" in plain


def test_no_history_no_rows() -> None:
    """Before any history (or from an older state.json) there is no goodput row and the loss is the heartbeat's."""
    text = render_status(Status(state=State.RUNNING, loss=1.5), running=True, now=0.0, spark=True)
    assert "goodput" not in text and "loss: 1.5" in text


class TestUntrustedText:
    def test_paths_and_reasons_from_disk_cannot_break_rows_or_drive_the_terminal(self) -> None:
        """A checkpoint named with a newline and an exit detail with an escape sequence are shown escaped."""
        from supervisor.policy.state import ExitInfo
        st = Status(state=State.BACKOFF, reason="crash\x1b[2J", resumed_from="/c/step_1\nFAKE: row",
                    latest_checkpoint={"step": 1, "path": "/c/step_1\nFAKE: row", "mtime": None},
                    last_exit=ExitInfo(code=1, signal=None, reason="crash", detail="boom\x1b]0;title\x07", at=0.0))
        text = render_status(st, running=False, now=0.0)
        assert "\x1b" not in text and "\x07" not in text and "FAKE: row" in text
        assert not any(line.startswith("FAKE") for line in text.splitlines())
        assert "\\n" in text and "\\x1b" in text
        line = one_line(st)
        assert "\n" not in line and "\x1b" not in line


@pytest.mark.parametrize(("code", "sig", "shown"), [
    (None, None, "last exit: stopped\n"),            # a graceful stop: no code, and never "signal None"
    (1, None, "last exit: crash (code 1)"),
    (None, "SIGKILL", "last exit: signal (signal SIGKILL)"),
])
def test_last_exit_shows_only_what_is_known(code: int | None, sig: str | None, shown: str) -> None:
    from supervisor.policy.state import ExitInfo

    reason = {None: "stopped", 1: "crash"}.get(code, "signal") if sig is None else "signal"
    st = Status(state=State.STOPPED, last_exit=ExitInfo(code=code, signal=sig, reason=reason, at=0.0))
    text = render_status(st, running=False, now=0.0) + "\n"
    assert shown in text and "None" not in text, text


def test_a_failures_last_output_is_shown_under_its_exit() -> None:
    """The job's last lines, one row each, under the last exit; not when they only repeat the detail."""
    from supervisor.policy.state import ExitInfo

    ex = ExitInfo(code=1, signal=None, reason="crash", at=0.0, detail="rank 0: exitcode 2: fatal: no data",
                  last_output=["loading", "fatal: no data"])
    text = render_status(Status(state=State.FAILED, last_exit=ex), running=False, now=0.0)
    assert "restarts: 0, last exit: crash (code 1) rank 0: exitcode 2: fatal: no data\n" in text
    assert "last output: loading\n                 fatal: no data\n" in text
    ex.last_output = ["fatal: no data"]
    assert "last output" not in render_status(Status(state=State.FAILED, last_exit=ex), running=False, now=0.0)


def test_goodput_says_where_the_time_went() -> None:
    """The parts of the supervisor's wall time beside the percentage (a failure-free 12% needs its start-up)."""
    parts = {"wall_s": 485.0, "productive_s": 60.0, "startup_s": 400.0, "checkpoint_overhead_s": 5.0,
             "restart_s": 0.0, "lost_s": 0.0, "other_s": 20.0}
    text = render_status(Status(state=State.COMPLETED, goodput=0.1237, goodput_parts=parts), running=False, now=0.0)
    assert ("goodput: 12.4% of 8m05s: productive 60s, start-up 6m40s, checkpoints 5s, restarts 0s, lost 0s, "
            "other 20s\n") in text


def test_a_job_without_steps_has_an_unknown_goodput_not_zero() -> None:
    parts = {"wall_s": 200.0, "productive_s": 0.0, "startup_s": 199.0, "other_s": 1.0}
    text = render_status(Status(state=State.COMPLETED, goodput=None, goodput_parts=parts), running=False, now=0.0)
    assert "goodput: unknown: the job reports no steps (no heartbeat)" in text and "0.0%" not in text


def test_no_none_in_human_output() -> None:
    """Whatever is unknown (a checkpoint without a step, an exit without a code) is left out, never printed `None`."""
    from supervisor.policy.state import ExitInfo

    st = Status(state=State.BACKOFF, attempt=2, step=None, latest_checkpoint={"path": "/c/epoch_3", "step": None,
                                                                             "mtime": None},
                best_checkpoint={"path": "/c/epoch_2", "step": None, "metric": "val_loss", "value": 1.5},
                last_exit=ExitInfo(code=None, signal=None, reason="hang", at=0.0, detail=None, last_output=None),
                goodput=None, goodput_parts={}, disk_free_bytes=10, resumed_from="/c/epoch_3")
    text = render_status(st, running=True, now=0.0) + "\n" + one_line(st)
    assert "None" not in text, text
    assert "last checkpoint: /c/epoch_3\n" in text and "best checkpoint: val_loss 1.5 /c/epoch_2" in text
    assert "ckpt epoch_3" in one_line(st)


def test_ranks_stragglers_hang_and_the_last_failure() -> None:
    """The watched ranks, a straggler with its step time, the last hang's culprit and stacks, the last failure's cost."""
    st = status()
    st.ranks = [{"rank": 0, "step": 57, "phase": "train", "step_s": 0.1, "at": 0.0, "straggler": False},
                {"rank": 1, "step": 56, "phase": "train", "step_s": 0.4, "at": 0.0, "straggler": True}]
    st.stragglers = [1]
    st.last_hang = {"attempt": 1, "at": 0.0, "step": 63, "idle_s": 10.0,
                    "ranks": [{"rank": 1, "why": "stopped (SIGSTOP or SIGTSTP)"}], "stacks": "/run/errors/a.stacks.txt"}
    st.last_failure = {"attempt": 1, "reason": "hang", "reached": 63, "resumed": 53, "steps_lost": 10,
                       "hung_ranks": [1], "time_lost_s": {"detection": 10.0, "stop": 2.5, "relaunch": 0.3,
                                                          "worker_start": 3.9, "load": 1.7, "redo": 0.5}}
    text = render_status(st, running=True, now=0.0)
    assert "ranks: 2 watched, steps 56-57 (behind: rank 1)" in text
    assert "stragglers: rank 1 0.4 s/step, others 0.1 s" in text
    assert ("last hang: attempt 1 at step 63: rank 1 stopped (SIGSTOP or SIGTSTP); "
            "stack dumps: /run/errors/a.stacks.txt") in text
    assert ("last failure: attempt 1 hang (hung: rank 1): 10 steps lost (reached 63, resumed from 53); 18.9 s lost: "
            "detection 10.0, stop 2.5, relaunch 0.3, worker start 3.9, load 1.7, redo 0.5") in text
    st.last_failure = {**st.last_failure, "reached_by": "heartbeat"}  # no per-rank files: the node's beat may lag
    assert ("last failure: attempt 1 hang (hung: rank 1): at least 10 steps lost (reached 63 or later: the job "
            "writes no per-rank heartbeats; resumed from 53)") in render_status(st, running=True, now=0.0)


def test_a_failures_time_lost_is_unknown_where_beats_did_not_measure_it() -> None:
    """Issue 35 item 10: a kill of a job without a heartbeat said "0.0 s lost: stop 0.0, relaunch 0.0"."""
    st = status()
    st.last_failure = {"attempt": 2, "reason": "signal", "reached": None, "resumed": 66, "steps_lost": None,
                       "time_lost_s": {"detection": None, "stop": 0.0, "relaunch": 0.026, "worker_start": None,
                                       "load": None, "redo": None}}
    text = render_status(st, running=True, now=0.0)
    assert ("last failure: attempt 2 signal; time lost unknown (detection, worker start, load, redo not measured): "
            "stop 0.0, relaunch 0.0") in text and "0.0 s lost" not in text, text


def test_a_job_without_a_heartbeat_takes_its_step_from_the_newest_checkpoint() -> None:
    """Issue 35 item 10: no beat, a checkpoint of step 40: the step row says 40 and where it comes from."""
    st = Status(state=State.RUNNING, latest_checkpoint={"path": "/c/epoch_40", "step": 40, "mtime": 0.0})
    assert "step: 40 (the newest checkpoint's; no heartbeat)" in render_status(st, running=True, now=0.0)


def test_an_open_divergence_is_shown() -> None:
    st = status()
    st.divergence = {"onset_step": 140, "step": 141, "rank": None, "loss": None, "why": "nan", "attempt": 2,
                     "rollbacks": 1, "resume_step": 120, "skip": 30, "last_good": "/c/step_00000120", "action": "rollback"}
    text = render_status(st, running=True, now=0.0)
    assert "DIVERGED: nan at step 140 (seen at step 141), rollbacks 1, last good: /c/step_00000120" in text
