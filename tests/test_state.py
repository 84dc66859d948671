"""State machine transitions and the atomic state.json round trip."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.observe.humanize import human_age, human_bytes
from supervisor.policy.state import TRANSITIONS, ExitInfo, State, Status
from supervisor.daemon.statefile import read_status, write_status
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
        assert not list(tmp_path.glob(".state-*"))

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
