"""Pure restart policy: tables of histories -> decisions, plus property tests."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from supervisor.config import RestartSection
from supervisor.policy.restarts import (
    Attempt,
    Finish,
    GiveUp,
    Restart,
    backoff_delay,
    corrupt_quarantine,
    decide,
    quarantine_candidate,
)


def fail(n: int, *, dur: float = 5.0, progressed: bool = False, resumed: str | None = None, step: int | None = None,
         max_step: int | None = None, new_ckpt: bool = False, reason: str = "crash",
         beat_checkpoint: str | None = None) -> Attempt:
    return Attempt(number=n, started_at=n * 1000.0, ended_at=n * 1000.0 + dur, succeeded=False, reason=reason,
                   resumed_from=resumed, resumed_step=step, max_step=max_step, new_checkpoint=new_ckpt,
                   progressed=progressed, beat_checkpoint=beat_checkpoint)


def ok(n: int) -> Attempt:
    return Attempt(number=n, started_at=0, ended_at=1, succeeded=True, reason="completed")


CFG = RestartSection(backoff_jitter=0)


class TestDecide:
    def test_success_finishes_under_on_failure(self) -> None:
        """A clean exit ends supervision with 'completed'."""
        assert decide([ok(1)], CFG) == Finish("completed")

    def test_always_restarts_after_success(self) -> None:
        """policy=always relaunches even after exit 0."""
        assert isinstance(decide([ok(1)], RestartSection(policy="always", backoff_jitter=0)), Restart)

    def test_never_gives_up_on_first_failure(self) -> None:
        """policy=never turns the first failure into give-up."""
        d = decide([fail(1)], RestartSection(policy="never"))
        assert isinstance(d, GiveUp) and "never" in d.reason

    def test_crash_loop_launches_exactly_one_plus_n(self) -> None:
        """With max_no_progress_restarts=3 a job that always fails is launched 4 times, then given up."""
        history: list[Attempt] = []
        launches = 0
        while True:
            launches += 1
            history.append(fail(launches))
            d = decide(history, RestartSection(max_no_progress_restarts=3))
            if not isinstance(d, Restart):
                break
        assert launches == 4
        assert isinstance(d, GiveUp) and "crash loop" in d.reason

    def test_progress_resets_the_no_progress_count(self) -> None:
        """A failure that made progress does not count toward the crash loop."""
        h = [fail(1), fail(2), fail(3, progressed=True), fail(4), fail(5), fail(6)]
        assert isinstance(decide(h, RestartSection(max_no_progress_restarts=3)), Restart)
        assert isinstance(decide([*h, fail(7)], RestartSection(max_no_progress_restarts=3)), GiveUp)

    def test_budget_spent(self) -> None:
        """max_restarts bounds the total number of relaunches, progress or not."""
        h = [fail(i, progressed=True) for i in range(1, 4)]
        d = decide(h, RestartSection(max_restarts=2))
        assert isinstance(d, GiveUp) and "budget" in d.reason
        assert isinstance(decide(h[:2], RestartSection(max_restarts=2)), Restart)


class TestBackoff:
    @pytest.mark.parametrize(
        ("failures", "expected"),
        [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, 300.0), (20, 300.0)],
    )
    def test_exponential_and_capped(self, failures: int, expected: float) -> None:
        """Delay doubles per consecutive failure from 1 s and is capped at backoff_max_s."""
        cfg = RestartSection(backoff_jitter=0, max_no_progress_restarts=100)
        assert backoff_delay([fail(i) for i in range(1, failures + 1)], cfg, 0.5) == expected

    def test_healthy_run_resets(self) -> None:
        """A failure after running reset_after_s restarts at once; the next unhealthy one waits 1 s again."""
        cfg = RestartSection(backoff_jitter=0, reset_after_s=600)
        h = [fail(1), fail(2), fail(3), fail(4, dur=601)]
        assert backoff_delay(h, cfg, 0.5) == 0.0
        assert backoff_delay([*h, fail(5)], cfg, 0.5) == 1.0
        assert backoff_delay([*h, fail(5), fail(6)], cfg, 0.5) == 2.0

    def test_progress_resets(self) -> None:
        """A failure after progress restarts at once (like torchrun's own restart), whatever came before."""
        cfg = RestartSection(backoff_jitter=0)
        assert backoff_delay([fail(1), fail(2), fail(3, progressed=True)], cfg, 0.5) == 0.0
        assert backoff_delay([fail(1), fail(2, progressed=True), fail(3)], cfg, 0.5) == 1.0

    def test_healthy_restart_delay_is_configurable(self) -> None:
        """healthy_restart_delay_s replaces the immediate restart after progress (multi-node agents need it)."""
        cfg = RestartSection(backoff_jitter=0, healthy_restart_delay_s=5)
        assert backoff_delay([fail(1, progressed=True)], cfg, 0.5) == 5.0
        assert backoff_delay([fail(1, progressed=True), fail(2)], cfg, 0.5) == 1.0

    def test_restart_after_success_waits_initial(self) -> None:
        """policy=always after a clean exit waits backoff_initial_s: a job that exits 0 at once never spins."""
        cfg = RestartSection(policy="always", backoff_jitter=0)
        assert backoff_delay([ok(1)], cfg, 0.5) == 1.0
        assert decide([ok(1), ok(2)], cfg) == Restart(1.0, reason="completed")

    @given(st.integers(1, 40), st.floats(0, 0.999), st.floats(0, 1))
    def test_jitter_stays_in_band(self, n: int, u: float, jit: float) -> None:
        """Jitter never leaves [base*(1-j), base*(1+j)] nor exceeds the cap."""
        cfg = RestartSection(backoff_jitter=jit, max_no_progress_restarts=100)
        base = backoff_delay([fail(i) for i in range(1, n + 1)], RestartSection(backoff_jitter=0), 0.5)
        d = backoff_delay([fail(i) for i in range(1, n + 1)], cfg, u)
        assert base * (1 - jit) - 1e-9 <= d <= min(cfg.backoff_max_s, base * (1 + jit)) + 1e-9


C20, C10 = "/c/step_20", "/c/step_10"


def died_loading(n: int, path: str | None = C20, step: int | None = 20, **kw) -> Attempt:  # type: ignore[no-untyped-def]
    """An attempt whose last heartbeat said `load`: it died loading `path` (passed to it unless told otherwise)."""
    return replace(fail(n, resumed=path, step=step, max_step=kw.pop("max_step", step), **kw), beat=True,
                   last_phase="load")


class TestCorrupt:
    """A load that found a known checkpoint's bytes failing their checksums (reason `corrupt`, policy/exits.py)."""

    def test_quarantined_at_once_naming_the_error(self) -> None:
        a = fail(1, resumed="/r/step_5", reason="corrupt")
        found = corrupt_quarantine(a, "rank 0: CheckpointCorruptError: checkpoint corrupt: /r/step_5/x bytes 0-9")
        assert found is not None and found.path == "/r/step_5" and "/r/step_5/x bytes 0-9" in found.reason
        assert corrupt_quarantine(fail(1, beat_checkpoint="/r/step_5", reason="corrupt"), None) is not None
        assert corrupt_quarantine(fail(1, reason="corrupt"), "x") is None  # which checkpoint: unknown
        assert corrupt_quarantine(fail(1, resumed="/r/step_5"), "x") is None  # a plain crash

    def test_relaunched_at_once_and_not_counted(self) -> None:
        """No backoff, no restart spent, no failure in the no-progress streak: the checkpoint was at fault."""
        cfg = RestartSection(max_restarts=2, max_no_progress_restarts=1, backoff_jitter=0)
        corrupt = [fail(i, resumed=f"/r/step_{i}", reason="corrupt") for i in range(1, 6)]
        assert decide(corrupt, cfg) == Restart(0.0, reason="corrupt")
        d = decide([*corrupt, fail(6)], cfg)
        assert isinstance(d, Restart) and d.delay_s == cfg.backoff_initial_s  # the first failure that counts
        assert isinstance(decide([*corrupt, fail(6), fail(7)], cfg), GiveUp)  # as without the corrupt loads
        assert isinstance(decide([fail(6), fail(7)], cfg), GiveUp)
        budget = [fail(i, progressed=True) for i in range(6, 9)]
        assert isinstance(decide([*corrupt, *budget[:2]], cfg), Restart)  # 5 corrupt + 2: one restart spent
        assert isinstance(decide([*corrupt, *budget], cfg), GiveUp)

    def test_unknown_checkpoint_counts_as_a_crash(self) -> None:
        """Corrupt but nobody knows which checkpoint (nothing to quarantine): a failure like any other."""
        cfg = RestartSection(max_no_progress_restarts=1, backoff_jitter=0)
        assert isinstance(decide([fail(1, reason="corrupt"), fail(2, reason="corrupt")], cfg), GiveUp)


class TestQuarantine:
    def test_two_deaths_while_loading_the_same_checkpoint(self) -> None:
        """quarantine_after consecutive attempts whose heartbeat died in `load` on C quarantine C, saying why."""
        q = quarantine_candidate([died_loading(1), died_loading(2)], 2)
        assert q is not None and q.path == C20 and "while loading it" in q.reason

    def test_no_heartbeat_is_no_evidence(self) -> None:
        """Attempts that wrote no heartbeat and failed right after launch quarantine nothing (issue 11.2/17.2)."""
        h = [fail(1, resumed=C20, step=20), fail(2, resumed=C20, step=20), fail(3, resumed=C20, step=20)]
        assert quarantine_candidate(h, 2) is None
        assert quarantine_candidate(h, 3) is None

    def test_no_heartbeat_after_another_checkpoint_loaded_and_trained(self) -> None:
        """Without a heartbeat, C is quarantined only when an earlier attempt loaded another one and progressed."""
        wrote_it = fail(1, resumed=C10, step=10, new_ckpt=True, progressed=True)
        q = quarantine_candidate([wrote_it, fail(2, resumed=C20, step=20), fail(3, resumed=C20, step=20)], 2)
        assert q is not None and q.path == C20 and "another checkpoint" in q.reason
        fresh = fail(1, new_ckpt=True, progressed=True)  # trained from scratch: the load path itself is unproven
        assert quarantine_candidate([fresh, fail(2, resumed=C20, step=20), fail(3, resumed=C20, step=20)], 2) is None

    def test_a_checkpoint_that_loaded_and_trained_in_this_run_is_not_blamed(self) -> None:
        """An earlier attempt trained from C: later deaths while loading it are not C's fault."""
        trained = fail(1, resumed=C20, step=20, max_step=25, progressed=True)
        assert quarantine_candidate([trained, died_loading(2), died_loading(3)], 2) is None

    def test_the_job_picking_its_own_checkpoint(self) -> None:
        """resume_args without a placeholder: only a checkpoint named by the `load` beat can be quarantined."""
        named = [died_loading(i, path=None, step=None, beat_checkpoint=C20) for i in (1, 2)]
        q = quarantine_candidate(named, 2)
        assert q is not None and q.path == C20
        unnamed = [died_loading(i, path=None, step=None) for i in (1, 2)]
        assert quarantine_candidate(unnamed, 2) is None

    @pytest.mark.parametrize(
        "second",
        [
            died_loading(2, max_step=25),  # trained past it
            died_loading(2, new_ckpt=True),  # committed a newer one
            died_loading(2, path=C10, step=10),  # another checkpoint
            replace(died_loading(2), last_phase="train"),  # died training, not loading
            replace(died_loading(2), beat=False, last_phase=None),  # a job that beats wrote none: died before loading
            ok(2),
        ],
    )
    def test_not_quarantined(self, second: Attempt) -> None:
        """Progress, a different checkpoint, a death outside `load` or a success breaks the streak."""
        assert quarantine_candidate([died_loading(1), second], 2) is None

    def test_off_and_fresh_start(self) -> None:
        """quarantine_after=0 is off, and attempts that loaded nothing never quarantine."""
        assert quarantine_candidate([died_loading(1), died_loading(2)], 0) is None
        assert quarantine_candidate([died_loading(1, path=None, step=None), died_loading(2, path=None, step=None)],
                                    2) is None

    @given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(0, 10))
    def test_property_give_up_only_after_streak(self, progress: list[bool], n: int) -> None:
        """decide() gives up for a crash loop exactly when the trailing no-progress streak exceeds N."""
        h = [fail(i + 1, progressed=p) for i, p in enumerate(progress)]
        streak = 0
        for p in reversed(progress):
            if p:
                break
            streak += 1
        d = decide(h, RestartSection(max_no_progress_restarts=n, max_restarts=1000))
        assert isinstance(d, GiveUp) == (streak > n)


_PATHS = st.sampled_from([None, "/c/step_1", "/c/step_2", "/c/step_3"])
_ATTEMPT = st.tuples(st.sampled_from([True, True, False]), st.booleans(), _PATHS, _PATHS,
                     st.sampled_from(["crash", "corrupt", "signal"]),
                     st.sampled_from([None, "load", "train"]), st.floats(1, 2000))


class TestWindow:
    @settings(max_examples=300)
    @example([(True, True, "/c/step_1", None, "crash", "train", 5.0)] * 40, 3, 2, 30)  # the budget, past the window
    @given(st.lists(_ATTEMPT, min_size=1, max_size=60), st.integers(0, 4), st.integers(0, 3), st.integers(0, 40))
    def test_the_window_answers_as_the_whole_history(self, specs: list[tuple[object, ...]], streak: int,
                                                     quarantine_after: int, max_restarts: int) -> None:
        """Every decision, backoff, quarantine and crash-loop count is the same from the attempts `window` keeps
        (kept step by step, as the daemon does) as from the whole history; and the kept list stays short."""
        from supervisor.policy.restarts import KEEP_PROGRESSED, crash_loop, window
        cfg = RestartSection(backoff_jitter=0, max_no_progress_restarts=streak, quarantine_after=quarantine_after,
                             max_restarts=max_restarts)
        whole: list[Attempt] = []
        kept: list[Attempt] = []
        let_go = 0
        for i, (progressed, beat, resumed, named, reason, phase, dur) in enumerate(specs):
            a = replace(fail(i, dur=dur, progressed=bool(progressed), resumed=resumed, reason=str(reason),  # type: ignore[arg-type]
                             beat_checkpoint=named), beat=bool(beat), last_phase=phase)  # type: ignore[arg-type]
            whole.append(a)
            kept, n = window([*kept, a], cfg)
            let_go += n
            assert decide(kept, cfg, before=let_go) == decide(whole, cfg)
            assert quarantine_candidate(kept, quarantine_after) == quarantine_candidate(whole, quarantine_after)
            assert crash_loop(kept, cfg) == crash_loop(whole, cfg)
            assert len([a for a in kept if a.reason != "corrupt"]) <= streak + quarantine_after + 2 + KEEP_PROGRESSED
            if not isinstance(decide(whole, cfg), Restart):  # the run ends here: no later attempt
                break
