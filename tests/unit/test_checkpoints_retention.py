"""Tests for supervisor.checkpoints.retention: the pure retention planner and its invariants."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from supervisor.checkpoints import CheckpointInfo, DiskUsage, KeepBest, RetentionRules, plan_retention
from supervisor.checkpoints.retention import GIB

ROOT = Path("/ckpt")
NOW = 100_000.0
BIG_DISK = DiskUsage(total_bytes=1000 * GIB, free_bytes=900 * GIB)


def ck(step, state="complete", *, mtime=None, size=GIB, pinned=False, quarantined=False, metrics=None, name=None):
    name = name or f"step_{step:08d}"
    return CheckpointInfo(name=name, path=ROOT / name, step=step, state=state, reason=None if state == "complete" else "x",
                          size_bytes=size, mtime=float(step if mtime is None else mtime), pinned=pinned,
                          quarantined=quarantined, metrics=metrics or {})


def deleted(plan) -> set[str]:
    return {d.name for d in plan.deletions}


def plan(cps, *, disk=BIG_DISK, protect=(), now=NOW, **policy):
    return plan_retention(cps, rules=RetentionRules(**policy), disk=disk, protect=protect, now=now)


# ---- strategies ---------------------------------------------------------------------------------

_STATES = ["complete"] * 4 + ["partial", "torn", "invalid", "unverified", "foreign"]
_rare = st.sampled_from([False, False, False, True])
_row = st.tuples(
    st.one_of(st.none(), st.integers(0, 40)),  # step
    st.sampled_from(_STATES),
    st.integers(0, 4 * GIB),  # size
    st.floats(0, NOW + 10, allow_nan=False),  # mtime
    _rare,  # pinned
    _rare,  # quarantined
    st.dictionaries(st.sampled_from(["loss", "acc"]), st.floats(-5, 5, allow_nan=False), max_size=2),
)


def _infos(rows) -> list[CheckpointInfo]:
    return [CheckpointInfo(name=f"c{i}", path=ROOT / f"c{i}", step=step, state=state, reason=None, size_bytes=size,
                           mtime=mtime, pinned=pinned, quarantined=quarantined, metrics=metrics)
            for i, (step, state, size, mtime, pinned, quarantined, metrics) in enumerate(rows)]


checkpoint_sets = st.lists(_row, max_size=12).map(_infos)
policies = st.builds(
    RetentionRules,
    keep_last=st.integers(0, 4),
    keep_every=st.integers(0, 5),
    keep_best=st.one_of(st.none(), st.builds(KeepBest, metric=st.sampled_from(["loss", "acc", "nope"]),
                                             mode=st.sampled_from(["min", "max"]), k=st.integers(0, 3))),
    min_free_gb=st.sampled_from([0, 1, 10, 60]),
    max_total_gb=st.sampled_from([0, 2, 10]),
    partial_max_age_s=st.sampled_from([0, 100, 3600, 30 * 86400]),
)
disks = st.builds(lambda total, frac: DiskUsage(total, int(total * frac)),
                  st.integers(GIB, 100 * GIB), st.floats(0, 1))


@st.composite
def scenarios(draw):
    cps = draw(checkpoint_sets)
    protect = draw(st.lists(st.sampled_from([c.path for c in cps]), max_size=2)) if cps else []
    return cps, draw(policies), draw(disks), protect, NOW + draw(st.floats(0, 5000))


def run(scenario):
    cps, policy, disk, protect, now = scenario
    return plan_retention(cps, rules=policy, disk=disk, protect=protect, now=now)


def _order(c):
    return (c.step is not None, c.step or 0, c.mtime)


def _newest_usable(cps):
    usable = [c for c in cps if c.complete and not c.quarantined]
    return max(usable, key=_order) if usable else None


PROPS = settings(max_examples=100, deadline=None)  # ~12 invariants x 100 scenarios: seconds, not minutes


class TestInvariants:
    @PROPS
    @given(scenarios())
    def test_newest_complete_is_never_deleted(self, sc):
        """The newest complete, non-quarantined checkpoint survives every policy and disk state."""
        newest = _newest_usable(sc[0])
        assert newest is None or newest.path not in {d.path for d in run(sc).deletions}

    @PROPS
    @given(scenarios())
    def test_protected_paths_are_never_deleted(self, sc):
        """Nothing in the protect set (the checkpoint in use) is deleted."""
        assert not {d.path for d in run(sc).deletions} & set(sc[3])

    @PROPS
    @given(scenarios())
    def test_pinned_are_never_deleted(self, sc):
        """Pinned checkpoints are never deleted."""
        pinned = {c.path for c in sc[0] if c.pinned}
        assert not {d.path for d in run(sc).deletions} & pinned

    @PROPS
    @given(scenarios())
    def test_young_partial_dirs_are_never_deleted(self, sc):
        """A partial or torn dir idle no longer than partial_max_age_s is never deleted."""
        cps, policy, _, _, now = sc
        young = {c.path for c in cps if c.state in ("partial", "torn") and now - c.mtime <= policy.partial_max_age_s}
        assert not {d.path for d in run(sc).deletions} & young

    @PROPS
    @given(scenarios())
    def test_foreign_entries_are_never_deleted_nor_counted(self, sc):
        """Foreign entries (not checkpoints) are never deleted, and the plan is the same without them."""
        cps, policy, disk, protect, now = sc
        foreign = {c.path for c in cps if c.state == "foreign"}
        got = run(sc)
        assert not {d.path for d in got.deletions} & foreign
        ours = [c for c in cps if c.state != "foreign"]
        without = plan_retention(ours, rules=policy, disk=disk, protect=[p for p in protect if p not in foreign], now=now)
        assert got.deletions == without.deletions and got.findings == without.findings

    @PROPS
    @given(scenarios())
    def test_invalid_and_unverified_are_never_deleted(self, sc):
        """Invalid dirs (maybe symlinks, maybe a newer torch's format) and unverified ones are left alone."""
        hands_off = {c.path for c in sc[0] if c.state in ("invalid", "unverified")}
        assert not {d.path for d in run(sc).deletions} & hands_off

    @PROPS
    @given(scenarios())
    def test_deletions_are_unique_members_of_the_input(self, sc):
        """Every deletion names a listed checkpoint, once, with a reason and its size."""
        by_path = {c.path: c for c in sc[0]}
        dels = run(sc).deletions
        assert len({d.path for d in dels}) == len(dels)
        for d in dels:
            assert d.path in by_path and d.reason and d.size_bytes == by_path[d.path].size_bytes

    @PROPS
    @given(scenarios())
    def test_kept_and_deleted_partition_the_input(self, sc):
        """Each checkpoint is either deleted or kept with a reason, never both."""
        p = run(sc)
        deleted_paths = {d.path for d in p.deletions}
        assert deleted_paths.isdisjoint(p.kept)
        assert deleted_paths | set(p.kept) == {c.path for c in sc[0]}

    @PROPS
    @given(scenarios())
    def test_disk_pressure_is_reported_exactly_when_a_floor_stays_unmet(self, sc):
        """After the plan, a floor is unmet if and only if a disk_pressure finding says so."""
        cps, policy, disk, _, _ = sc
        p = run(sc)
        freed = sum(d.size_bytes for d in p.deletions)
        ours = sum(c.size_bytes for c in cps if c.state != "foreign")  # foreign entries are never counted
        free, total = disk.free_bytes + freed, ours - freed
        unmet = (policy.min_free_gb and free < policy.min_free_gb * GIB) or (
            policy.max_total_gb and total > policy.max_total_gb * GIB)
        assert bool(unmet) == any(f.kind == "disk_pressure" for f in p.findings)

    @PROPS
    @given(scenarios())
    def test_disk_deletions_take_the_oldest_first(self, sc):
        """No complete checkpoint older than a disk-driven deletion survives unless it is guarded."""
        cps, _, _, protect, _ = sc
        p = run(sc)
        gone = {d.path for d in p.deletions}
        disk_gone = [c for c in cps if c.path in {d.path for d in p.deletions if d.reason.startswith("disk:")}]
        newest = _newest_usable(cps)
        for d in disk_gone:
            for k in cps:
                if k.complete and k.path not in gone and _order(k) < _order(d):
                    assert k.pinned or k.path in protect or (newest is not None and k.path == newest.path)

    @PROPS
    @given(scenarios())
    def test_disk_deletions_stop_once_the_floor_is_met(self, sc):
        """Undoing the last disk-driven deletion would leave a floor unmet: no deletion is gratuitous."""
        cps, policy, disk, _, _ = sc
        p = run(sc)
        if not p.deletions or not p.deletions[-1].reason.startswith("disk:"):
            return
        freed = sum(d.size_bytes for d in p.deletions[:-1])
        ours = sum(c.size_bytes for c in cps if c.state != "foreign")  # foreign entries are never counted
        free, total = disk.free_bytes + freed, ours - freed
        assert (policy.min_free_gb and free < policy.min_free_gb * GIB) or (
            policy.max_total_gb and total > policy.max_total_gb * GIB)

    @PROPS
    @given(scenarios())
    def test_without_rules_or_floors_complete_checkpoints_stay(self, sc):
        """With every keep rule and floor off, no complete checkpoint is deleted."""
        cps, policy, disk, protect, now = sc
        off = policy.model_copy(update={"keep_last": 0, "keep_every": 0, "keep_best": None,
                                        "min_free_gb": 0, "max_total_gb": 0})
        p = plan_retention(cps, rules=off, disk=disk, protect=protect, now=now)
        assert not [d for d in p.deletions if d.path in {c.path for c in cps if c.complete}]

    @PROPS
    @given(scenarios())
    def test_planning_is_pure(self, sc):
        """The same input gives the same plan, and the input list is not modified."""
        before = copy.deepcopy(sc[0])
        assert run(sc) == run(sc)
        assert sc[0] == before


class TestKeepRules:
    def test_keep_last_keeps_the_newest_n(self):
        """keep_last=2 keeps the two newest complete checkpoints and deletes the rest."""
        p = plan([ck(s) for s in (10, 20, 30, 40)], keep_last=2)
        assert deleted(p) == {"step_00000010", "step_00000020"}
        assert all(d.reason == "kept by no keep rule" for d in p.deletions)

    def test_keep_every_keeps_multiples(self):
        """keep_every=20 keeps steps divisible by 20 on top of keep_last."""
        p = plan([ck(s) for s in (10, 20, 30, 40, 50)], keep_last=1, keep_every=20)
        assert deleted(p) == {"step_00000010", "step_00000030"}

    @pytest.mark.parametrize("mode,kept", [("min", "step_00000020"), ("max", "step_00000030")])
    def test_keep_best_uses_the_manifest_metric(self, mode, kept):
        """keep_best keeps the best by the metric in the chosen direction."""
        cps = [ck(10, metrics={"loss": 2.0}), ck(20, metrics={"loss": 1.0}), ck(30, metrics={"loss": 3.0}), ck(40)]
        p = plan(cps, keep_last=0, keep_best=KeepBest(metric="loss", mode=mode, k=1))
        survivors = {c.name for c in cps} - deleted(p)
        assert survivors == {kept, "step_00000040"}

    def test_all_rules_off_keeps_everything_complete(self):
        """With keep_last=0 and no other rule, retention deletes no complete checkpoint."""
        assert deleted(plan([ck(s) for s in (1, 2, 3)], keep_last=0)) == set()

    def test_quarantined_newest_does_not_shield_itself(self):
        """A quarantined newest is not the protected newest; the one below it is."""
        cps = [ck(10), ck(20), ck(30, quarantined=True)]
        p = plan(cps, keep_last=0, keep_every=1000, min_free_gb=2000)
        assert deleted(p) == {"step_00000010", "step_00000030"}


class TestDebrisAndDisk:
    def test_old_partial_goes_young_partial_stays(self):
        """Partial dirs idle past partial_max_age_s go; younger ones stay."""
        cps = [ck(5), ck(6, "partial", mtime=NOW - 7200, name=".tmp-a"), ck(7, "partial", mtime=NOW - 60, name=".tmp-b")]
        p = plan(cps, partial_max_age_s=3600)
        assert deleted(p) == {".tmp-a"} and "idle" in p.deletions[0].reason

    def test_min_free_deletes_oldest_until_met(self):
        """Below min_free_gb, the oldest kept checkpoints go until the floor is met, then no more."""
        cps = [ck(s, size=10 * GIB) for s in (1, 2, 3, 4)]
        disk = DiskUsage(total_bytes=100 * GIB, free_bytes=5 * GIB)
        p = plan(cps, disk=disk, keep_last=4, min_free_gb=20)
        assert [d.name for d in p.deletions] == ["step_00000001", "step_00000002"]
        assert all(d.reason.startswith("disk: free") for d in p.deletions) and not p.findings

    def test_max_total_deletes_oldest(self):
        """Over max_total_gb, the oldest kept checkpoints go."""
        cps = [ck(s, size=10 * GIB) for s in (1, 2, 3)]
        assert [d.name for d in plan(cps, keep_last=3, max_total_gb=15).deletions] == ["step_00000001", "step_00000002"]

    def test_unmeetable_floor_is_a_finding_not_a_broken_invariant(self):
        """When only guarded checkpoints remain, the floor stays unmet and disk_pressure says by how much."""
        cps = [ck(1, pinned=True), ck(2), ck(3)]
        disk = DiskUsage(total_bytes=10 * GIB, free_bytes=1 * GIB)
        p = plan(cps, disk=disk, protect=[ROOT / "step_00000002"], keep_last=3, min_free_gb=5)
        assert deleted(p) == set()
        (f,) = p.findings
        assert f.kind == "disk_pressure" and f.needed_bytes == 4 * GIB and "min_free_gb=5" in f.message


class TestPolicyModel:
    def test_defaults(self):
        """The defaults are keep_last=3, no other rule, no floors, 1 h partial age."""
        p = RetentionRules()
        assert (p.keep_last, p.keep_every, p.keep_best, p.min_free_gb, p.max_total_gb, p.partial_max_age_s) == (
            3, 0, None, 0, 0, 3600)

    @pytest.mark.parametrize("kwargs", [{"keep_last": -1}, {"min_free_gb": -0.5}, {"keep_lats": 3},
                                        {"keep_best": {"metric": "loss", "mode": "median", "k": 1}}])
    def test_bad_values_and_unknown_keys_are_rejected(self, kwargs):
        """Negative values, unknown keys and a bad keep_best mode fail validation."""
        with pytest.raises(ValidationError):
            RetentionRules(**kwargs)

    def test_every_field_is_described(self):
        """Each field has a description (it feeds --help and the config reference)."""
        assert all(f.description for f in RetentionRules.model_fields.values())


class TestSettled:
    """settled=True: the job is down and picks its own checkpoint, so no save is in flight."""

    def test_unfinished_saves_above_the_newest_complete_go_at_once(self):
        """Partial or torn and above the newest complete: deleted whatever their age; below it they wait."""
        cps = [ck(10), ck(5, "partial", mtime=NOW), ck(20, "partial", mtime=NOW), ck(30, "torn", mtime=NOW),
               ck(40, "invalid", mtime=NOW)]
        assert deleted(plan(cps, keep_last=0)) == set()
        got = plan_retention(cps, rules=RetentionRules(keep_last=0), disk=BIG_DISK, now=NOW, settled=True)
        assert deleted(got) == {"step_00000020", "step_00000030"}
        assert all("would load" in d.reason for d in got.deletions)

    def test_nothing_without_a_complete_checkpoint_or_when_pinned(self):
        """No complete checkpoint to resume from: the unfinished ones wait as before; a pin always wins."""
        alone = [ck(20, "partial", mtime=NOW)]
        assert deleted(plan_retention(alone, rules=RetentionRules(), disk=BIG_DISK, now=NOW, settled=True)) == set()
        pinned = [ck(10), ck(20, "partial", mtime=NOW, pinned=True)]
        assert deleted(plan_retention(pinned, rules=RetentionRules(), disk=BIG_DISK, now=NOW, settled=True)) == set()
