"""The node-local tier: one order across two roots, retention per root, and the config rules that keep it safe."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from supervisor.checkpoints import (
    COMPLETE,
    CheckpointInfo,
    DiskUsage,
    RetentionRules,
    Tier,
    in_use,
    local_rules,
    merged,
    newest_across,
    plan_retention,
    scan,
    scan_local,
    scan_tiers,
)
from supervisor.checkpoints.lineage import root_lineage
from supervisor.checkpoints.retention import GIB
from supervisor.checkpoints.tiers import TierClaims
from supervisor.cli import app as top_cli
from supervisor.config import load_config
from supervisor.daemon.housekeeping import Housekeeper
from supervisor.errors import ClaimedError, ConfigError
from supervisor.policy.resume import Launch, plan_resume
from tests.jobs.dcp_files import write_checkpoint
from tests.unit.test_config import _with, write

DISK = DiskUsage(total_bytes=100 * GIB, free_bytes=90 * GIB)


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Path, Path]:
    durable, local = tmp_path / "ckpts", tmp_path / "shm" / "ckpts"
    durable.mkdir()
    local.mkdir(parents=True)
    return durable, local


def _ours(durable: Path, local: Path, step: int, **kw: object) -> Path:
    """A local checkpoint of the durable root's run (its lineage in the manifest: checkpoints/lineage.py)."""
    ck = write_checkpoint(local, step, **kw)  # type: ignore[arg-type]
    raw = json.loads((ck / "manifest.json").read_text())
    raw["lineage"] = root_lineage(durable, create=True)
    (ck / "manifest.json").write_text(json.dumps(raw))
    return ck


def _tear(path: Path) -> None:
    next(p for p in path.iterdir() if p.name.endswith(".distcp")).unlink()


class TestOneOrder:
    def test_the_local_checkpoint_is_chosen_when_newest(self, tiers: tuple[Path, Path]) -> None:
        """Durable 10 and 20, local 25: the resume is the local 25, tagged `local`."""
        durable, local = tiers
        for step in (10, 20):
            write_checkpoint(durable, step)
        _ours(durable, local, 25)
        best = newest_across(durable, local)
        assert best is not None and (best.path, best.tier) == (local / "step_00000025", Tier.LOCAL)

    def test_a_torn_local_checkpoint_falls_back_to_the_durable_one(self, tiers: tuple[Path, Path]) -> None:
        """The local 25 lost a shard: the durable 20 is the resume, never the torn copy."""
        durable, local = tiers
        write_checkpoint(durable, 20)
        _tear(_ours(durable, local, 25))
        best = newest_across(durable, local)
        assert best is not None and (best.step, best.tier) == (20, Tier.DURABLE)
        launch = plan_resume(scan_tiers(durable, local), resume_args=["--resume", "{checkpoint}"],
                             allow_fresh_start=False)
        assert isinstance(launch, Launch) and launch.checkpoint is not None and launch.checkpoint.step == 20

    @pytest.mark.parametrize(("durable_steps", "local_steps", "first"), [
        ([10, 20], [25], (Tier.LOCAL, 25)),  # newer than the newest durable: the local one
        ([30], [30], (Tier.DURABLE, 30)),  # the same step: the durable one, whatever the mtimes
        ([30], [25, 30], (Tier.DURABLE, 30)),
        ([30], [25], (Tier.DURABLE, 30)),  # older: the durable one
        ([], [5], (Tier.LOCAL, 5)),
        ([10], [], (Tier.DURABLE, 10)),
    ])
    def test_the_order_across_tiers(self, durable_steps: list[int], local_steps: list[int],
                                    first: tuple[Tier, int]) -> None:
        """The one order (tiers.tier_order, pure): by step; a local checkpoint wins only when it is newer than the
        newest durable one, at equal steps the durable one wins (even when the local copy was written later)."""
        def info(tier: Tier, step: int) -> CheckpointInfo:
            return CheckpointInfo(f"step_{step}", Path(f"/{tier.value}/step_{step}"), step, COMPLETE, None, 1,
                                  mtime=float(step) + (0.5 if tier is Tier.LOCAL else 0.0), tier=tier)

        ranked = merged([info(Tier.DURABLE, s) for s in durable_steps], [info(Tier.LOCAL, s) for s in local_steps])
        assert (ranked[0].tier, ranked[0].step) == first

    @pytest.mark.parametrize(("local_step", "lineage", "chosen"), [
        (25, "same", (Tier.LOCAL, 25)),  # this run's, newer: resumed
        (20, "same", (Tier.DURABLE, 20)),  # this run's, the same step: the durable one
        (25, "other", (Tier.DURABLE, 20)),  # another run's (local_tier_foreign): never, however new
        (25, None, (Tier.DURABLE, 20)),  # none recorded: never
    ])
    def test_the_resume_across_tiers(self, tiers: tuple[Path, Path], local_step: int, lineage: str | None,
                                     chosen: tuple[Tier, int]) -> None:
        """newest_across (the trainer's `--resume auto`, the same order as the supervisor's pass) on real roots."""
        durable, local = tiers
        write_checkpoint(durable, 20)
        ck = _ours(durable, local, local_step)
        if lineage != "same":
            raw = json.loads((ck / "manifest.json").read_text())
            (ck / "manifest.json").write_text(json.dumps({**raw, "lineage": lineage and "0123456789abcdef"}))
        best = newest_across(durable, local)
        assert best is not None and (best.tier, best.step) == chosen

    def test_a_missing_local_root_is_an_empty_tier(self, tiers: tuple[Path, Path]) -> None:
        """A tmpfs after a reboot: nothing local, the durable newest is the resume."""
        durable, local = tiers
        write_checkpoint(durable, 10)
        shutil.rmtree(local)
        assert scan_local(local) == [] and newest_across(durable, local).tier == Tier.DURABLE  # type: ignore[union-attr]

    def test_merged_is_newest_first_across_tiers(self, tiers: tuple[Path, Path]) -> None:
        """Steps interleave across the roots in one newest-first list; each entry names its tier."""
        durable, local = tiers
        for step in (10, 20):
            write_checkpoint(durable, step)
        for step in (15, 25):
            _ours(durable, local, step)
        got = [(c.step, c.tier) for c in merged(scan(durable), scan(local))]
        assert got == [(25, Tier.LOCAL), (20, Tier.DURABLE), (15, Tier.LOCAL), (10, Tier.DURABLE)]


class TestRetentionPerTier:
    def test_the_local_tier_keeps_its_newest_complete(self, tiers: tuple[Path, Path]) -> None:
        """local_keep = 1: older local checkpoints go; the newest stays; the durable root's rules never apply."""
        _durable, local = tiers
        for step in (3, 6, 9):
            write_checkpoint(local, step)
        plan = plan_retention(scan_local(local), rules=local_rules(RetentionRules(keep_last=5), 1), disk=DISK, now=1e12)
        assert sorted(d.name for d in plan.deletions) == ["step_00000003", "step_00000006"]

    def test_the_local_tier_never_deletes_the_one_in_use_or_a_save_in_flight(self, tiers: tuple[Path, Path]) -> None:
        """The job resumed from local 3 (in use) and step 12 is being written: both stay, with local_keep = 1."""
        _durable, local = tiers
        for step in (3, 6, 9):
            write_checkpoint(local, step)
        (local / ".tmp-step_00000012-abcd").mkdir()
        infos = scan_local(local)
        rules = local_rules(RetentionRules(), 1)
        plan = plan_retention(infos, rules=rules, disk=DISK, protect={local / "step_00000003"},
                              now=max(c.mtime for c in infos) + 1)
        assert [d.name for d in plan.deletions] == ["step_00000006"]

    def test_the_durable_root_keeps_its_rules_whatever_the_local_tier_holds(self, tiers: tuple[Path, Path]) -> None:
        """A newer local checkpoint does not make the durable newest deletable: retention plans each root alone."""
        durable, local = tiers
        for step in (10, 20, 30):
            write_checkpoint(durable, step)
        _ours(durable, local, 35)
        plan = plan_retention(scan(durable), rules=RetentionRules(keep_last=1), disk=DISK, now=1e12)
        assert sorted(d.name for d in plan.deletions) == ["step_00000010", "step_00000020"]
        assert local_rules(RetentionRules(min_free_gb=50, keep_every=10), 2) == RetentionRules(keep_last=2)


class TestConfig:
    def test_local_dir_resolves_and_reaches_the_job(self, tmp_path: Path) -> None:
        """A relative local_dir resolves against the config's folder; local_keep defaults to 1."""
        cfg = load_config(write(tmp_path, _with(checkpoints='dir = "ckpts"\nlocal_dir = "shm/ckpts"')))
        assert cfg.checkpoints.local_dir == tmp_path / "shm" / "ckpts" and cfg.checkpoints.local_keep == 1

    @pytest.mark.parametrize(("checkpoints", "needle"), [
        ('dir = "ckpts"\nlocal_dir = "ckpts/local"', "overlap"),
        ('dir = "ckpts/durable"\nlocal_dir = "ckpts"', "overlap"),
        ('dir = "ckpts"\nlocal_dir = "ckpts"', "overlap"),
        ('dir = "ckpts"\nlocal_dir = ".."', "[checkpoints.local_dir]"),
        ('dir = "ckpts"\nlocal_dir = "l"\nlocal_keep = 0', "[checkpoints.local_keep]"),
    ])
    def test_a_local_dir_that_overlaps_is_refused(self, tmp_path: Path, checkpoints: str, needle: str) -> None:
        """The local tier is a root of its own: never inside the durable root or around it, or the config's folder."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, _with(checkpoints=checkpoints)))
        assert needle in str(ei.value)

    @pytest.mark.parametrize(("nnodes", "env"), [
        (["--nnodes=2"], ""), (["--nnodes", "1:4"], ""), (["--nnodes=$NNODES"], ""),
        (["--nnode", "2"], ""), (["--nn=2"], ""),  # abbreviations torchrun's argparse accepts
        (["--nnodes=1", "--nnodes=2"], ""),  # the last one wins
        ([], 'PET_NNODES = "2"'),  # torchrun's default for an absent --nnodes
    ])
    def test_a_multi_node_job_is_refused_the_local_tier(self, tmp_path: Path, nnodes: list[str], env: str) -> None:
        """torchrun --nnodes other than 1: a resume could pick a step another node's tier lacks; exit 2 says why."""
        command = str(["torchrun", *nnodes, "-m", "trainer"]).replace("'", '"')
        job = f"env = {{ {env} }}\n" if env else ""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, _with(command=command, job=job, checkpoints='dir = "c"\nlocal_dir = "l"')))
        assert "single-node" in str(ei.value) and ei.value.exit_code == 2

    @pytest.mark.parametrize("nnodes", [[], ["--nnodes=1"], ["--nnodes", "1:1"], ["--nnodes=2", "--nnodes=1"]])
    def test_a_single_node_job_may_use_it(self, tmp_path: Path, nnodes: list[str]) -> None:
        """One node (or no --nnodes at all): the tier is first-class."""
        command = str(["torchrun", *nnodes, "-m", "trainer"]).replace("'", '"')
        cfg = load_config(write(tmp_path, _with(command=command, checkpoints='dir = "c"\nlocal_dir = "l"')))
        assert cfg.checkpoints.local_dir == tmp_path / "l"

    def test_the_jobs_own_nnodes_flag_is_not_torchruns(self, tmp_path: Path) -> None:
        """`--nnodes 4` after the job's module is the job's own argument: torchrun runs one node."""
        command = '["torchrun", "--standalone", "-m", "trainer", "--nnodes", "4"]'
        cfg = load_config(write(tmp_path, _with(command=command, checkpoints='dir = "c"\nlocal_dir = "l"')))
        assert cfg.checkpoints.local_dir == tmp_path / "l"

    def test_a_multi_node_job_without_the_tier_is_fine(self, tmp_path: Path) -> None:
        """The refusal is about the tier only."""
        command = '["torchrun", "--nnodes=2", "-m", "trainer"]'
        assert load_config(write(tmp_path, _with(command=command))).checkpoints.local_dir is None


class TestDaemonPass:
    """The supervisor's housekeeping pass over both roots (supervisor/daemon/housekeeping.py)."""

    def _house(self, tmp_path: Path, keep: int = 1) -> Housekeeper:
        cfg = write(tmp_path, _with(checkpoints=f'dir = "ckpts"\nlocal_dir = "shm/ckpts"\nlocal_keep = {keep}\n'
                                                'keep_last = 2'))
        return Housekeeper(load_config(cfg), log=None, now=lambda: 1e12)

    def test_a_pass_ranks_both_tiers_and_prunes_each_by_its_rules(self, tmp_path: Path) -> None:
        """Durable keeps its 2 newest, local its 1 newest; the pass's newest is the local 25."""
        durable, local = tmp_path / "ckpts", tmp_path / "shm" / "ckpts"
        for step in (10, 20, 30):
            write_checkpoint(durable, step)
        for step in (15, 25, 35):
            _ours(durable, local, step)
        house = self._house(tmp_path)
        result = house.run_pass(generation=0, protect=[local / "step_00000015"])
        assert result.error is None
        assert sorted(d.name for d in result.deleted) == ["step_00000010", "step_00000025"]
        assert result.newest is not None and (result.newest.step, result.newest.tier) == (35, Tier.LOCAL)
        assert [(c.step, c.tier) for c in result.checkpoints] == [
            (35, Tier.LOCAL), (30, Tier.DURABLE), (20, Tier.DURABLE), (15, Tier.LOCAL)]

    def test_the_in_use_marker_goes_next_to_the_root_that_holds_the_resume_point(self, tmp_path: Path) -> None:
        """Resumed from the local tier: its marker sits beside the local root, so a `prune` of it honours it."""
        local = tmp_path / "shm" / "ckpts"
        write_checkpoint(local, 5)
        (tmp_path / "ckpts").mkdir()
        house = self._house(tmp_path)
        house.mark_in_use(local / "step_00000005", os.getpid(), None)
        assert in_use(local) == {local / "step_00000005"} and in_use(tmp_path / "ckpts") == set()
        house.clear_in_use()
        assert in_use(local) == set()

    def test_a_missing_local_root_is_no_error(self, tmp_path: Path) -> None:
        """The tier vanished (tmpfs after a reboot): the pass still judges the durable root."""
        write_checkpoint(tmp_path / "ckpts", 10)
        result = self._house(tmp_path).run_pass(generation=0, protect=[])
        assert result.error is None and result.newest is not None and result.newest.tier == Tier.DURABLE


class TestCli:
    def _config(self, tmp_path: Path) -> Path:
        durable, local = tmp_path / "ckpts", tmp_path / "shm" / "ckpts"
        for step in (10, 20):
            write_checkpoint(durable, step)
        for step in (15, 25):
            _ours(durable, local, step)
        return write(tmp_path, _with(checkpoints='dir = "ckpts"\nlocal_dir = "shm/ckpts"\nkeep_last = 5'))

    def test_list_shows_the_tier(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`checkpoints list -c` with a local tier: both roots, newest first, a TIER column and `tier` in JSON."""
        cfg = self._config(tmp_path)
        assert top_cli.main(["checkpoints", "list", "-c", str(cfg)]) == 0
        rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()]
        assert rows == [["TIER", "NAME", "STEP"], ["local", "step_00000025", "25"], ["durable", "step_00000020", "20"],
                        ["local", "step_00000015", "15"], ["durable", "step_00000010", "10"]]
        assert top_cli.main(["checkpoints", "list", "-c", str(cfg), "--json"]) == 0
        assert [(c["step"], c["tier"]) for c in json.loads(capsys.readouterr().out)] == [
            (25, "local"), (20, "durable"), (15, "local"), (10, "durable")]

    def test_prune_applies_each_tiers_rules(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`checkpoints prune -c`: the durable root keeps its 5, the local tier its 1 newest; each line names its tier."""
        cfg = self._config(tmp_path)
        assert top_cli.main(["checkpoints", "prune", "-c", str(cfg)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "durable: nothing to delete" and out[1].startswith("local: deleted step_00000015")
        assert sorted(p.name for p in (tmp_path / "shm" / "ckpts").iterdir()) == ["step_00000025"]


class _FakeClaim:
    def __init__(self, root: str, fail: str | None = None, why: str | None = None) -> None:
        self.root, self.fail, self.why, self.held, self.refreshed = Path(root), fail, why, False, 0

    def acquire(self) -> list[tuple[str, str]]:
        if self.fail:
            raise ClaimedError(self.fail)
        self.held = True
        return [("note", str(self.root))]

    def check(self) -> str | None:
        return self.why

    def refresh(self) -> None:
        self.refreshed += 1

    def release(self) -> None:
        self.held = False


class TestTierClaims:
    def test_both_roots_are_claimed_or_neither(self) -> None:
        """The local tier's claim refused: the durable root's claim is given back, and the refusal propagates."""
        durable, local = _FakeClaim("/d"), _FakeClaim("/l", fail="held by another job")
        claims = TierClaims([durable, local])  # type: ignore[list-item]
        with pytest.raises(ClaimedError):
            claims.acquire()
        assert not durable.held and claims.root == Path("/d")

    def test_check_and_refresh_cover_every_root(self) -> None:
        """A launch is refused when either root's claim is; every pass refreshes both."""
        durable, local = _FakeClaim("/d"), _FakeClaim("/l", why="local tier held by job B")
        claims = TierClaims([durable, local])  # type: ignore[list-item]
        assert claims.acquire() == [("note", "/d"), ("note", "/l")]
        assert claims.check() == "local tier held by job B"
        claims.refresh()
        claims.release()
        assert (durable.refreshed, local.refreshed, durable.held, local.held) == (1, 1, False, False)
