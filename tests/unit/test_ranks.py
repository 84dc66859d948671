"""supervisor/policy/ranks.py: the slowest source's deadline, hung ranks, stragglers (pure, tables)."""
from __future__ import annotations

import pytest

from supervisor.config import HealthSection
from supervisor.contract import Beat, Phase
from supervisor.policy.attempt import hang_timeout
from supervisor.policy.ranks import MIN_GAPS, STRAGGLER_LOOKS, RankWatch

HEALTH = HealthSection(hang_timeout_s=10, save_timeout_s=100)


def b(step: int, phase: Phase = Phase.TRAIN, step_s: float | None = None, time: float | None = None) -> Beat:
    return Beat(step, time, phase, None, None, step_s)


class TestProgress:
    def test_only_a_changed_beat_is_progress(self) -> None:
        """The same record read again is no progress; any change is."""
        w = RankWatch()
        assert w.see(0, b(1), 0.0) and not w.see(0, b(1), 5.0) and w.see(0, b(2), 6.0)
        assert w.sources[0].changed == 6.0

    def test_the_slowest_source_sets_the_deadline_with_its_own_phase_allowance(self) -> None:
        """Each source gets its phase's allowance from its own last change; the earliest end counts."""
        w = RankWatch()
        w.see(None, b(5), 0.0)
        w.see(0, b(5), 1.0)
        w.see(1, b(5), 4.0)
        assert w.deadline(HEALTH) == 10.0
        w.see(0, b(6), 7.0)
        w.see(None, b(6), 8.0)
        assert w.deadline(HEALTH) == 14.0  # rank 1's train allowance
        w.see(0, b(6, Phase.SAVE), 9.0)
        w.see(1, b(6, Phase.SAVE), 12.0)
        assert w.deadline(HEALTH) == 109.0  # both save: rank 0's save allowance (the node's file may wait for them)
        assert w.deadline(HealthSection(hang_timeout_s=0)) is None

    @pytest.mark.parametrize("phase", [Phase.SAVE, Phase.EVAL, Phase.LOAD])
    def test_ranks_waiting_for_one_that_saves_alone_are_not_hung(self, phase: Phase) -> None:
        """Rank 0 saves (or evaluates, or loads) alone while rank 1 waits for it at a barrier: rank 1's quiet is
        judged by rank 0's allowance, not its own train allowance (the old single-file contract gave the same)."""
        w = RankWatch()
        w.see(1, b(30), 0.0)
        w.see(0, b(30, phase), 0.5)
        allowance = 100.0 if phase in (Phase.SAVE, Phase.LOAD) else 10.0
        assert w.deadline(HEALTH) == 0.5 + allowance
        w.see(0, b(30, phase, time=5.0), 5.0)  # rank 0 still at it, beating
        assert w.deadline(HEALTH) == 5.0 + allowance
        w.see(0, b(31), 6.0)  # rank 0 trains again: everyone by their own allowance
        assert w.deadline(HEALTH) == 10.0

    def test_a_freeze_postpones_every_allowance(self) -> None:
        """Frozen 30 s, 4 s into a 10 s allowance: 6 s of it are left after the thaw; the silence counts all."""
        w = RankWatch()
        w.see(0, b(5), 0.0)
        w.postpone(30.0)
        assert w.deadline(HEALTH) == 40.0
        assert w.idle(35.0) == 35.0


class TestCulprits:
    @pytest.mark.parametrize(("states", "steps", "named"), [
        ({0: "sleeping", 1: "stopped"}, {0: 5, 1: 5}, [(1, "stopped (SIGSTOP or SIGTSTP)")]),
        ({0: "disk-sleep", 1: "sleeping"}, {0: 5, 1: 6}, [(0, "in uninterruptible sleep (I/O)")]),
        ({0: "sleeping", 1: "sleeping"}, {0: 6, 1: 5, 2: 6}, [(1, "behind: step 5, others up to 6")]),
        ({0: "sleeping", 1: "running"}, {0: 5, 1: 5}, []),  # lockstep, nobody behind: the beats cannot tell
        ({}, {}, []),
    ])
    def test_table(self, states: dict[int, str], steps: dict[int, int], named: list[tuple[int, str]]) -> None:
        """Workers that cannot run come first; else the ranks behind; else nobody."""
        w = RankWatch()
        for rank, step in steps.items():
            w.see(rank, b(step), 0.0)
        assert [(c.rank, c.why) for c in w.culprits(states)] == named


class TestStragglers:
    def looks(self, w: RankWatch, times: dict[int, float], n: int, start: int = 0) -> list[tuple[int, bool]]:
        out = []
        for i in range(n):
            for rank, t in times.items():
                w.see(rank, b(start + i, step_s=t), float(i))
            out += [(c.rank, c.flagged) for c in w.look(1.5)]
        return out

    def test_flagged_only_after_staying_slow(self) -> None:
        """Above 1.5x the others' median for STRAGGLER_LOOKS looks in a row; one fast look resets the count."""
        w = RankWatch()
        assert self.looks(w, {0: 0.1, 1: 0.1, 2: 0.3}, STRAGGLER_LOOKS - 1) == []
        assert self.looks(w, {0: 0.1, 1: 0.1, 2: 0.3}, 1, start=10) == [(2, True)]
        assert w.stragglers() == [2]

    def test_cleared_when_it_is_no_longer_slow(self) -> None:
        w = RankWatch()
        self.looks(w, {0: 0.1, 1: 0.5}, STRAGGLER_LOOKS)
        assert w.stragglers() == [1]
        changes = self.looks(w, {0: 0.1, 1: 0.1}, 10, start=10)
        assert changes == [(1, False)] and w.stragglers() == []

    def test_equal_ranks_and_a_single_rank_are_never_stragglers(self) -> None:
        w = RankWatch()
        assert self.looks(w, {0: 0.2, 1: 0.2, 2: 0.2}, 10) == []
        solo = RankWatch()
        assert self.looks(solo, {0: 9.0}, 10) == []

    def test_without_step_s_the_rate_between_beats_counts(self) -> None:
        """A job that reports no step_s: seconds per step from its beats' own times."""
        w = RankWatch()
        for i in range(STRAGGLER_LOOKS + 2):
            w.see(0, b(10 * i, time=float(i)), float(i))  # 0.1 s/step
            w.see(1, b(2 * i, time=float(i)), float(i))  # 0.5 s/step
            w.look(1.5)
        assert w.stragglers() == [1]

    def test_factor_zero_is_off(self) -> None:
        w = RankWatch()
        for i in range(10):
            w.see(0, b(i, step_s=0.1), 0.0)
            w.see(1, b(i, step_s=9.0), 0.0)
            assert w.look(0) == []


AUTO = HealthSection(hang_min_s=60, hang_factor=10, save_timeout_s=1800)  # hang_timeout_s = "auto", the default


class TestAuto:
    @pytest.mark.parametrize(("health", "phase", "p99", "allowance"), [
        (AUTO, Phase.TRAIN, None, 1800),  # too few steps seen: a slow first step is no hang
        (AUTO, Phase.TRAIN, 1.0, 60),  # a fast job: hang_min_s
        (AUTO, Phase.TRAIN, 30.0, 300),  # a slow one: hang_factor x p99
        (AUTO, None, 30.0, 300),
        (AUTO, Phase.EVAL, 1.0, 1800),  # an evaluation is not a step
        (AUTO, Phase.SAVE, 1.0, 1800),
        (HealthSection(hang_timeout_s=10), Phase.EVAL, 1.0, 10),  # a number: as before
        (HealthSection(hang_timeout_s=0), Phase.TRAIN, 1.0, None),
    ])
    def test_allowance(self, health: HealthSection, phase: Phase | None, p99: float | None,
                       allowance: float | None) -> None:
        """max(hang_min_s, hang_factor x p99) for a step; the phase allowances as they were."""
        assert hang_timeout(health, b(1, phase), startup=False, p99=p99) == allowance  # type: ignore[arg-type]

    def test_p99_of_training_gaps_once_enough_are_seen(self) -> None:
        """Gaps count from a training beat to the next step; a save's length is no step time; MIN_GAPS first."""
        w = RankWatch()
        t = 0.0
        for step in range(MIN_GAPS):
            w.see(None, b(step), t)
            t += 1.0
        assert w.p99() is None and w.deadline(AUTO) == (MIN_GAPS - 1) + 1800.0
        w.see(None, b(MIN_GAPS, Phase.SAVE), t)
        w.see(None, b(MIN_GAPS + 1), t + 500)  # after a 500 s save: not a gap
        assert w.p99() == 1.0 and w.deadline(AUTO) == t + 500 + 60

    def test_status_says_what_detection_does(self) -> None:
        """Off because the job does not beat, off by setting, or the allowance in force."""
        w = RankWatch()
        assert "does not beat" in w.describe(AUTO)
        assert w.describe(HealthSection(hang_timeout_s=0)) == "off (hang_timeout_s = 0)"
        w.see(None, b(1), 1.0)
        assert "until 10 steps" in w.describe(AUTO)
        for step in range(2, 20):
            w.see(None, b(step), float(step))
        assert w.describe(AUTO) == "auto: after 60 s (recent p99 step 1 s)"
        assert w.describe(HealthSection(hang_timeout_s=7)) == "after 7 s without progress"
