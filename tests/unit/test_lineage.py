"""A node-local checkpoint belongs to its run (supervisor/checkpoints/lineage.py): another run's is never resumed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from supervisor.checkpoints.lineage import foreign, root_lineage
from supervisor.checkpoints.tiers import newest_across
from supervisor.policy.resume import Launch, plan_resume
from tests.jobs.dcp_files import write_checkpoint


def _with_lineage(ck: Path, lineage: str | None) -> Path:
    raw = json.loads((ck / "manifest.json").read_text())
    raw["lineage"] = lineage
    (ck / "manifest.json").write_text(json.dumps(raw))
    return ck


def test_the_roots_lineage_is_kept_across_restarts_and_new_for_a_root_made_anew(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    assert root_lineage(root) is None
    first = root_lineage(root, create=True)
    assert first and root_lineage(root) == first and root_lineage(root, create=True) == first
    assert oct((root / ".fsdp-lineage.json").stat().st_mode)[-3:] == "600"
    shutil.rmtree(root)  # the README's way to start over
    root.mkdir()
    assert root_lineage(root) is None and root_lineage(root, create=True) not in (None, first)


def test_a_local_checkpoint_is_resumed_only_within_the_durable_roots_lineage(tmp_path: Path) -> None:
    durable, local = tmp_path / "ckpts", tmp_path / "shm"
    durable.mkdir()
    mine = root_lineage(durable, create=True)
    write_checkpoint(durable, 20)
    ck = _with_lineage(write_checkpoint(local, 25), mine)
    chosen = newest_across(durable, local)
    assert chosen is not None and chosen.path == ck  # newer, same run: the local copy
    for other in ("0123456789abcdef", None):  # another run's, or one that recorded none
        _with_lineage(ck, other)
        assert foreign(durable, ck) is not None and "never resumed" in (foreign(durable, ck) or "")
        chosen = newest_across(durable, local)
        assert chosen is not None and chosen.path == durable / "step_00000020"
    _with_lineage(ck, mine)
    shutil.rmtree(durable)  # started over: the old local save is not this run's
    durable.mkdir()
    assert newest_across(durable, local) is None


def test_the_daemons_pass_reports_and_skips_a_foreign_local_checkpoint(tmp_path: Path) -> None:
    """In a pass (daemon/integrity.py): `local_tier_foreign` names it, and the durable one is the resume point: the
    launch plans from the pass's `found`, where it is `foreign`, not only from its `good` ones."""
    from supervisor.checkpoints import merged, scan, scan_local
    from supervisor.daemon.integrity import good_ones

    durable, local = tmp_path / "ckpts", tmp_path / "shm"
    durable.mkdir()
    mine = root_lineage(durable, create=True)
    write_checkpoint(durable, 20)
    ck = _with_lineage(write_checkpoint(local, 25), "0123456789abcdef")
    found = merged(scan(durable), scan_local(local))
    usable = [c for c in found if c.complete and not c.quarantined]
    for lineage, newest, kinds in (("0123456789abcdef", durable / "step_00000020", ["local_tier_foreign"]),
                                   (mine, ck, [])):
        _with_lineage(ck, lineage)
        judged, good, findings = good_ones(found, usable, verify=True, roots=(durable, local))
        assert good[0].path == newest and [f.kind for f in findings] == kinds, findings
        plan = plan_resume(judged, resume_args=["--resume", "{checkpoint}"], allow_fresh_start=False)
        assert isinstance(plan, Launch) and plan.checkpoint is not None and plan.checkpoint.path == newest  # launched
    shutil.rmtree(durable)  # started over with the local tier left behind: a fresh start, not the other run's save
    durable.mkdir()
    root_lineage(durable, create=True)
    _with_lineage(ck, "0123456789abcdef")
    found = merged(scan(durable), scan_local(local))
    judged, good, _ = good_ones(found, [c for c in found if c.complete], verify=True, roots=(durable, local))
    plan = plan_resume(judged, resume_args=["--resume", "{checkpoint}"], allow_fresh_start=True)
    assert isinstance(plan, Launch) and plan.checkpoint is None and good == [], plan
