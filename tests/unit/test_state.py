"""State machine transitions and the atomic state.json round trip."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.daemon.statefile import read_status, write_status
from supervisor.observe.humanize import human_age, human_bytes
from supervisor.policy.state import TRANSITIONS, ExitInfo, ExitReason, State, Status
from tests.helpers import returns_despite_fifo


class TestTransitions:
    def test_final_states_are_terminal(self) -> None:
        """completed, stopped and failed allow no transition out."""
        for s in State:
            assert (TRANSITIONS[s] == frozenset()) == s.final

    def test_illegal_transition_raises(self) -> None:
        """A transition not in the table is a bug and raises."""
        st = Status(state=State.STOPPED)
        with pytest.raises(RuntimeError, match="stopped -> running"):
            st.transition(State.RUNNING)

    @pytest.mark.parametrize("start", [State.STARTING, State.RUNNING, State.BACKOFF, State.STOPPING])
    @pytest.mark.parametrize("end", [State.STOPPED, State.FAILED])
    def test_an_abrupt_end_leaves_any_unfinished_state(self, start: State, end: State) -> None:
        """The supervisor leaving without a verdict (abandon, close) ends any unfinished state, through transition()."""
        st = Status(state=start)
        st.transition(end, abrupt=True)
        assert st.state is end

    @pytest.mark.parametrize("start", [State.COMPLETED, State.STOPPED, State.FAILED])
    def test_an_abrupt_end_never_rewrites_a_verdict(self, start: State) -> None:
        """A final state stays final: an abrupt end after a verdict is still an illegal transition."""
        other = State.FAILED if start is not State.FAILED else State.STOPPED
        with pytest.raises(RuntimeError):
            Status(state=start).transition(other, abrupt=True)

    def test_an_abrupt_end_goes_nowhere_but_stopped_or_failed(self) -> None:
        """`abrupt` is no back door to other states (running -> completed without a judgement)."""
        with pytest.raises(RuntimeError):
            Status(state=State.STARTING).transition(State.COMPLETED, abrupt=True)

    def test_every_state_reachable_from_starting(self) -> None:
        """The documented graph reaches every state."""
        seen, todo = {State.STARTING}, [State.STARTING]
        while todo:
            for n in TRANSITIONS[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        assert seen == set(State)


class TestFile:
    def test_round_trip(self, tmp_path: Path) -> None:
        """What write_status writes, read_status reads back equal."""
        st = Status(state=State.BACKOFF, pid=1, attempt=2, restarts=1, last_exit=ExitInfo(1, None, "crash", 5.0, "rank 0"))
        write_status(tmp_path, st)
        assert read_status(tmp_path) == st
        assert not list(tmp_path.glob(".state.json.*"))

    @pytest.mark.parametrize("reason", ["preempted", "", "CRASH", "ExitReason.CRASH"])
    def test_an_exit_reason_this_version_does_not_know_is_kept(self, tmp_path: Path, reason: str) -> None:
        """A newer release's (or a hand-edited) last_exit.reason reads back as written; the rest of the state too.

        An unknown word made the whole file unreadable once: `status` said "no state" and a restarted `run` began
        its restart counters again from zero.
        """
        write_status(tmp_path, Status(state=State.RUNNING, restarts=2,
                                      last_exit=ExitInfo(code=1, signal=None, reason=reason, at=1.0)))
        st = read_status(tmp_path)
        assert st is not None and st.restarts == 2 and st.last_exit is not None and st.last_exit.reason == reason

    def test_a_known_exit_reason_reads_back_typed(self, tmp_path: Path) -> None:
        """A word of the vocabulary comes back as its ExitReason member."""
        write_status(tmp_path, Status(last_exit=ExitInfo(code=None, signal="SIGKILL", reason=ExitReason.OOM, at=1.0)))
        st = read_status(tmp_path)
        assert st is not None and st.last_exit is not None and st.last_exit.reason is ExitReason.OOM

    def test_torn_or_missing_reads_none(self, tmp_path: Path) -> None:
        """A missing or torn state.json reads as None, never raises."""
        assert read_status(tmp_path) is None
        (tmp_path / "state.json").write_text('{"state": "run')
        assert read_status(tmp_path) is None

    @pytest.mark.parametrize("field", ["restarts", "attempt", "goodput", "started_at"])
    def test_an_integer_beyond_any_float_reads_none(self, tmp_path: Path, field: str) -> None:
        """A 400-digit number in state.json is a state.json that cannot be parsed (it raised OverflowError in
        `status` and in `run`'s start-up)."""
        write_status(tmp_path, Status(state=State.RUNNING))
        text = (tmp_path / "state.json").read_text()
        (tmp_path / "state.json").write_text(text.rstrip().removesuffix("}") + f', "{field}": {"9" * 400}}}')
        assert read_status(tmp_path) is None

    def test_nested_or_planted_reads_none(self, tmp_path: Path) -> None:
        """A state.json nested deep enough to exhaust the parser, or a FIFO in its place: None, at once."""
        (tmp_path / "state.json").write_text("[" * 200_000)
        assert read_status(tmp_path) is None
        (tmp_path / "state.json").unlink()
        os.mkfifo(tmp_path / "state.json")
        assert returns_despite_fifo(tmp_path / "state.json", lambda: read_status(tmp_path)) is None


class TestHumanize:
    @pytest.mark.parametrize(("seconds", "text"), [(None, "?"), (-3, "0s"), (45, "45s"), (307, "5m07s"),
                                                     (11100, "3h05m"), (371000, "4d07h")])
    def test_age(self, seconds: float | None, text: str) -> None:
        """Durations read at the precision that matters, one format everywhere."""
        assert human_age(seconds) == text

    @pytest.mark.parametrize(("n", "text"), [(None, "?"), (0, "0 B"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB")])
    def test_bytes(self, n: int | None, text: str) -> None:
        assert human_bytes(n) == text
