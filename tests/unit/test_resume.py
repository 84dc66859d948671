"""What the next attempt is told to load, and when a fresh start is refused: tables over scans (pure)."""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.checkpoints import CheckpointInfo
from supervisor.policy.resume import Launch, Refuse, chooses_itself, passed_over, plan_resume

DEFAULT = ["--resume", "{checkpoint}"]


def ck(name: str, state: str = "complete", *, step: int | None = -1, quarantined: bool = False,
       reason: str | None = None) -> CheckpointInfo:
    digits = "".join(c for c in name if c.isdigit())
    return CheckpointInfo(name=name, path=Path("/r") / name, step=(int(digits) if digits else None) if step == -1 else step,
                          state=state, reason=reason, size_bytes=1, mtime=0.0, quarantined=quarantined)


class TestChoice:
    def test_newest_usable_with_both_placeholders(self) -> None:
        """{checkpoint} is the path and {step} the step of the newest complete, non-quarantined one."""
        scan = [ck("step-30", "torn", reason="short shard"), ck("step-20", quarantined=True), ck("step-10")]
        plan = plan_resume(scan, resume_args=["--from={checkpoint}", "--step", "{step}"], allow_fresh_start=False)
        assert plan == Launch(scan[2], ["--from=/r/step-10", "--step", "10"])

    def test_skip_counts_as_quarantined(self) -> None:
        """A checkpoint quarantined in memory (its marker could not be written) is not chosen either."""
        plan = plan_resume([ck("step_20"), ck("step_10")], resume_args=DEFAULT, allow_fresh_start=False,
                           skip={"/r/step_20"})
        assert isinstance(plan, Launch) and plan.checkpoint is not None and plan.checkpoint.name == "step_10"

    def test_step_placeholder_without_a_step_is_refused(self) -> None:
        """{step} with a step-less checkpoint: a refusal naming it, never a silent fresh start."""
        plan = plan_resume([ck("final")], resume_args=["--load_step", "{step}"], allow_fresh_start=True)
        assert isinstance(plan, Refuse) and "/r/final" in plan.reason and "{step}" in plan.reason

    @pytest.mark.parametrize(("scan", "args", "checks_loads", "refused"), [
        ([ck("step-20", "corrupt", quarantined=True, reason="x bytes 0-8"), ck("step-10")], [], False, True),
        ([ck("step-20", "corrupt", quarantined=True, reason="x bytes 0-8")], [], False, True),
        ([ck("step-20", "corrupt", quarantined=True, reason="x bytes 0-8"), ck("step-10")], [], True, False),
        ([ck("step-30"), ck("step-20", "corrupt", quarantined=True, reason="x bytes 0-8")], [], False, False),
        ([ck("step-20", "corrupt", quarantined=True, reason="x bytes 0-8"), ck("step-10")], DEFAULT, False, False),
    ])
    def test_a_job_that_would_pick_a_corrupt_checkpoint_itself_is_refused(
            self, scan: list[CheckpointInfo], args: list[str], checks_loads: bool, refused: bool) -> None:
        """Outside attack (issue 34): torchtitan, transformers' `resume_from_checkpoint=True` load the newest and know
        nothing of `.quarantined`: never launched onto a corrupt one above the newest good one. Not refused: a job
        that said `checks_loads` (the trainer library's `--resume auto` skips it), an older corrupt one, {checkpoint}."""
        plan = plan_resume(scan, resume_args=args, allow_fresh_start=True, checks_loads=checks_loads)
        assert isinstance(plan, Refuse) == refused, plan
        assert not refused or "/r/step-20, corrupt: x bytes 0-8" in plan.reason  # type: ignore[union-attr]

    @pytest.mark.parametrize("args", [[], ["--resume", "auto"]])
    def test_no_placeholder_leaves_the_choice_to_the_job(self, args: list[str]) -> None:
        """Without a placeholder nothing is named to the job (args are appended as they are when one exists)."""
        assert chooses_itself(args) and not chooses_itself(DEFAULT)
        assert plan_resume([ck("step_10")], resume_args=args, allow_fresh_start=False) == Launch(None, args)


class TestFreshStart:
    @pytest.mark.parametrize("scan", [
        [],
        [ck(".tmp-step_00000030-ab", "partial")],
        [ck("step_00000030", "partial", reason="no .metadata")],
    ])
    def test_empty_or_partial_only_starts_fresh(self, scan: list[CheckpointInfo]) -> None:
        """Nothing that was ever a checkpoint: launch without resume_args."""
        assert plan_resume(scan, resume_args=DEFAULT, allow_fresh_start=False) == Launch(None, [])

    @pytest.mark.parametrize(("scan", "words"), [
        ([ck("step_20", quarantined=True)], "every complete checkpoint is quarantined"),
        ([ck("step_20", "torn", reason="shard short")], "torn: shard short"),
        ([ck("step_20", "invalid", reason="unsafe .metadata")], "invalid: unsafe .metadata"),
    ])
    def test_unusable_checkpoint_refuses(self, scan: list[CheckpointInfo], words: str) -> None:
        """A quarantined, torn or invalid checkpoint and nothing usable: refused, naming it and the opt-in."""
        plan = plan_resume(scan, resume_args=DEFAULT, allow_fresh_start=False)
        assert isinstance(plan, Refuse) and words in plan.reason and "/r/step_20" in plan.reason
        assert "allow_fresh_start" in plan.reason
        assert plan_resume(scan, resume_args=DEFAULT, allow_fresh_start=True) == Launch(None, [])

    def test_refusal_names_a_few_and_counts_the_rest(self) -> None:
        """One line however many dirs: three named, the rest counted."""
        scan = [ck(f"step_{i}", "torn", reason="short") for i in range(5)]
        plan = plan_resume(scan, resume_args=DEFAULT, allow_fresh_start=False)
        assert isinstance(plan, Refuse) and "(+2 more)" in plan.reason and "\n" not in plan.reason


class TestPassedOver:
    """Issue 35 item 10: the dirs newer than the resume point, each with why, for `job_started`'s `skipped`."""

    def test_newer_torn_partial_and_quarantined_ones_are_named(self) -> None:
        chosen = ck("step-10")
        scan = [ck("step-40", "torn", reason="shard short"), ck(".tmp-step-35", "partial"), ck("step-30", "partial"),
                ck("step-20", quarantined=True), ck("runs", "foreign", step=None), chosen, ck("step-5")]
        assert passed_over(scan, chosen) == ["/r/step-40: torn (shard short)", "/r/step-30: partial",
                                             "/r/step-20: quarantined"]

    def test_the_newest_chosen_skips_nothing(self) -> None:
        chosen = ck("step-10")
        assert passed_over([chosen, ck("step-5")], chosen) == [] and passed_over([], chosen) == []
