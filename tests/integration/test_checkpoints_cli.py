"""Tests for supervisor.cli.checkpoints: the `checkpoints` commands, run as a real subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints import is_pinned, quarantine
from supervisor.layout import tmp_dir_name
from tests.jobs.dcp_files import write_checkpoint
from tests.unit.test_checkpoints_cli import root  # noqa: F401  (a fixture, taken as an argument)

LIST_FIELDS = {"name", "path", "step", "complete", "reason", "size_bytes", "mtime", "pinned", "quarantined"}


def fsup(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m supervisor ...` in its own session, killed if it outlives the timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", *map(str, args)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0]


class TestList:
    def test_json_has_the_fixed_fields_newest_first(self, root):
        """`list --json` is an array, newest first, each object with the documented fields and types."""
        r = fsup("checkpoints", "list", "--dir", root, "--json")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [(x["step"], x["complete"]) for x in rows] == [(40, False), (30, False), (20, True), (10, True)]
        for x in rows:
            assert LIST_FIELDS <= set(x)
            assert (x["reason"] is None) == x["complete"] and Path(x["path"]).is_absolute()
            assert isinstance(x["size_bytes"], int) and isinstance(x["mtime"], float)
        assert "missing" in rows[1]["reason"]

    def test_table_lists_every_dir(self, root):
        """The human form is a table with a header and one row per checkpoint."""
        r = fsup("checkpoints", "list", "--dir", root)
        lines = r.stdout.strip().splitlines()
        assert r.returncode == 0 and lines[0].split()[:3] == ["NAME", "STEP", "STATE"] and len(lines) == 5
        assert "torn" in lines[2] and "complete" in lines[3]

    def test_table_shows_why_a_checkpoint_is_quarantined(self, tmp_path):
        """A quarantined checkpoint's row carries the Q flag and the recorded reason."""
        quarantine(write_checkpoint(tmp_path, 10), "crashed twice after loading it")
        r = fsup("checkpoints", "list", "--dir", tmp_path)
        row = r.stdout.strip().splitlines()[1]
        assert " Q " in row and row.endswith("quarantined: crashed twice after loading it")

    def test_odd_names_stay_one_row_each(self, tmp_path, monkeypatch):
        """A newline in a name, or a byte that is not UTF-8, is escaped: one row per entry, even on a strict stdout."""
        write_checkpoint(tmp_path, 10, name="a\nstep_20")
        os.mkdir(os.path.join(os.fsencode(tmp_path), b"bad\xffname"))
        monkeypatch.setenv("PYTHONIOENCODING", "utf-8")
        r = fsup("checkpoints", "list", "--dir", tmp_path)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 3 and lines[1].startswith("a\\nstep_20 ") and lines[2].startswith("bad\\udcffname ")

    def test_missing_root_is_a_one_line_error(self, tmp_path):
        """A root that does not exist: one line naming it, exit 2."""
        one_line_error(fsup("checkpoints", "list", "--dir", tmp_path / "nope"), str(tmp_path / "nope"))

    def test_dir_and_config_are_mutually_exclusive(self, root):
        """Giving both --dir and -c is a usage error, exit 2."""
        one_line_error(fsup("checkpoints", "list", "--dir", root, "-c", "job.toml"))


class TestVerify:
    def test_complete_exits_0(self, root):
        """verify of a complete dir prints its state and exits 0."""
        r = fsup("checkpoints", "verify", root / "step_00000020")
        assert r.returncode == 0 and "complete" in r.stdout

    def test_torn_exits_1_with_reason(self, root):
        """verify of a torn dir exits 1 and names the missing shard."""
        r = fsup("checkpoints", "verify", root / "step_00000030", "--json")
        body = json.loads(r.stdout)
        assert r.returncode == 1 and body["state"] == "torn" and "__1_0.distcp" in body["reason"]
        assert body["complete"] is False

    def test_deep_reports_checksums(self, tmp_path):
        """verify --deep on a checksummed checkpoint says the checksums match."""
        d = write_checkpoint(tmp_path, 5, sha256=True)
        r = fsup("checkpoints", "verify", d, "--deep")
        assert r.returncode == 0 and "checksums match" in r.stdout

    def test_quarantine_is_shown(self, root):
        """A quarantined checkpoint still verifies complete and shows the quarantine reason."""
        quarantine(root / "step_00000020", "crashed twice after load")
        r = fsup("checkpoints", "verify", root / "step_00000020", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["quarantine_reason"] == "crashed twice after load"

    def test_missing_path_is_a_one_line_error(self, tmp_path):
        """verify of a path that does not exist: one line, exit 2."""
        one_line_error(fsup("checkpoints", "verify", tmp_path / "gone"), "gone")


class TestPrune:
    def test_dry_run_prints_and_deletes_nothing(self, root):
        """--dry-run prints each deletion with its reason and leaves the root unchanged."""
        before = sorted(os.listdir(root))
        r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1", "--dry-run")
        assert r.returncode == 0 and "would delete step_00000010" in r.stdout and "kept by no keep rule" in r.stdout
        assert sorted(os.listdir(root)) == before

    def test_prune_deletes_and_keeps_guarded(self, root):
        """prune --keep-last 1 deletes the older complete one; torn-in-flight and temp dirs stay (young)."""
        r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
        assert r.returncode == 0 and "deleted step_00000010" in r.stdout
        assert sorted(os.listdir(root)) == sorted(["step_00000020", "step_00000030", tmp_dir_name(40, "abc")])

    def test_pinned_survives_prune(self, root):
        """A pinned checkpoint is not deleted by prune."""
        assert fsup("checkpoints", "pin", "--dir", root, "step_00000010").returncode == 0  # the NAME `list` shows
        r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
        assert r.returncode == 0 and (root / "step_00000010").exists()

    def test_unmeetable_floor_warns(self, root):
        """A free-space floor nobody can meet is a disk_pressure warning on stderr, exit 0."""
        r = fsup("checkpoints", "prune", "--dir", root, "--min-free-gb", "1e12", "--dry-run")
        assert r.returncode == 0 and "disk_pressure" in r.stderr

    @pytest.mark.parametrize("flag,value", [("--keep-last", "-1"), ("--keep-last", "x"), ("--min-free-gb", "nan")])
    def test_bad_flag_is_a_one_line_error(self, root, flag, value):
        """A negative or non-numeric flag is a one-line usage error, exit 2, nothing deleted."""
        one_line_error(fsup("checkpoints", "prune", "--dir", root, flag, value), flag)
        assert (root / "step_00000010").exists()


class TestConfig:
    def test_config_supplies_dir_and_policy(self, root, tmp_path):
        """-c CONFIG reads [checkpoints] dir (relative to the file) and its keep_last."""
        cfg = tmp_path / "job.toml"
        cfg.write_text('[job]\ncommand = ["true"]\n\n[checkpoints]\ndir = "ckpts"\nkeep_last = 1\n')
        r = fsup("checkpoints", "prune", "-c", cfg, "--dry-run")
        assert r.returncode == 0, r.stderr
        assert "would delete step_00000010" in r.stdout and "step_00000020" not in r.stdout
        r = fsup("checkpoints", "list", "-c", cfg, "--json")
        assert [x["name"] for x in json.loads(r.stdout)][2:] == ["step_00000020", "step_00000010"]

    def test_missing_config_is_a_one_line_error(self, tmp_path):
        """A config file that does not exist: one line naming it, exit 2."""
        one_line_error(fsup("checkpoints", "list", "-c", tmp_path / "nope.toml"), "nope.toml")


class TestOneLinePerFact:
    """The CLI prints what it did; the store's own events are not echoed next to it (issue 13 class 10)."""

    def test_pin_and_unpin_print_once(self, root):
        """pin and unpin: exactly one line on stdout, nothing on stderr."""
        d = root / "step_00000010"
        for verb in ("pin", "unpin"):
            r = fsup("checkpoints", verb, "--dir", root, d)
            assert r.returncode == 0 and r.stdout.splitlines() == [f"{verb}ned {d}"] and r.stderr == "", (r.stdout, r.stderr)

    def test_prune_prints_each_deletion_once(self, root):
        """prune: one line per deletion, nothing else on either stream."""
        r = fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1")
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert [line.split(" (")[0] for line in r.stdout.splitlines()] == ["deleted step_00000010"], r.stdout

    @pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
    def test_prune_of_a_read_only_root_is_one_line(self, root):
        """The same with real permissions: a root we may not write into."""
        os.chmod(root, 0o555)
        try:
            one_line_error(fsup("checkpoints", "prune", "--dir", root, "--keep-last", "1"), "cannot prune")
        finally:
            os.chmod(root, 0o755)

    def test_unbounded_sizes_are_usage_errors(self, root):
        """--min-free-gb inf or 1e300 would overflow the planner: exit 2 naming the flag."""
        for value in ("inf", "1e300"):
            one_line_error(fsup("checkpoints", "prune", "--dir", root, "--min-free-gb", value, "--dry-run"), "--min-free-gb")


class TestPinCommands:
    def test_pin_unpin_round_trip(self, root):
        """pin then unpin toggles the marker the policy honours."""
        d = root / "step_00000010"
        assert fsup("checkpoints", "pin", "--dir", root, d).returncode == 0 and is_pinned(d)
        r = fsup("checkpoints", "unpin", "--dir", root, d)
        assert r.returncode == 0 and "unpinned" in r.stdout and not is_pinned(d)

    def test_pin_missing_is_a_one_line_error(self, tmp_path):
        """Pinning a path that does not exist: one line, exit 2."""
        one_line_error(fsup("checkpoints", "pin", "--dir", tmp_path, tmp_path / "nope"), "nope")


class TestLayouts:
    @pytest.fixture
    def accelerate_root(self, tmp_path) -> Path:
        """Accelerate's checkpoints/ (tests/jobs/accelerate_like.py), the last save cut between its members."""
        from tests.supervise import REPO

        project = tmp_path / "project"
        subprocess.run([sys.executable, str(REPO / "tests" / "jobs" / "accelerate_like.py"), "--project-dir", project,
                        "--step-s", "0", "--steps", "15", "--die-at-save", "15", "--die-after",
                        "pytorch_model_fsdp_0/.metadata"], cwd=REPO, capture_output=True, timeout=60)
        (project / "checkpoints" / "checkpoint_0" / "trainer_state.json").unlink()
        (project / "checkpoints" / "tensorboard").mkdir()
        return project / "checkpoints"

    def test_json_has_ordinal_step_and_foreign(self, accelerate_root):
        """`list --json`: checkpoint_N carries its ordinal, the sidecar's step (or null); foreign is its own state."""
        rows = json.loads(fsup("checkpoints", "list", "--dir", accelerate_root, "--json").stdout)
        got = [(x["name"], x["state"], x["step"], x["ordinal"], x["complete"]) for x in rows]
        assert got == [("checkpoint_2", "partial", None, 2, False), ("checkpoint_1", "complete", 10, 1, True),
                       ("checkpoint_0", "complete", None, 0, True), ("tensorboard", "foreign", None, None, False)]
        assert "optimizer_0 missing" in rows[0]["reason"] and "not a checkpoint" in rows[3]["reason"]
        assert rows[3]["size_bytes"] == 0

    def test_table_says_save_number_and_no_size_for_foreign(self, accelerate_root):
        """The table shows `save #N` when the step is unknown and `-` as the size of a foreign folder."""
        lines = fsup("checkpoints", "list", "--dir", accelerate_root).stdout.splitlines()
        row = {line.split()[0]: line for line in lines[1:]}
        assert " save #0 " in row["checkpoint_0"] and row["checkpoint_1"].split()[1] == "10"
        assert row["tensorboard"].split()[1:4] == ["-", "foreign", "-"]

    def test_verify_a_cut_folder_exits_1(self, accelerate_root):
        """`verify` holds a nested folder against its siblings, as `list` does."""
        r = fsup("checkpoints", "verify", accelerate_root / "checkpoint_2")
        assert r.returncode == 1 and "partial" in r.stdout and "optimizer_0 missing" in r.stdout
        assert fsup("checkpoints", "verify", accelerate_root / "checkpoint_1").returncode == 0

    def test_root_one_level_too_high_is_a_usage_error(self, tmp_path):
        """list and prune over torchtitan's dump folder: exit 2, one line naming the dir meant, nothing deleted."""
        out = tmp_path / "outputs"
        for step in (10, 20):
            write_checkpoint(out / "checkpoint", step, name=f"step-{step}", manifest=False)
        (out / "tb").mkdir()
        before = sorted(map(str, out.rglob("*")))
        for args in (["list"], ["prune", "--keep-last", "1"]):
            r = fsup("checkpoints", *args, "--dir", out)
            one_line_error(r, "holds a checkpoint directory", f'did you mean [checkpoints] dir = "{out}/checkpoint"?')
        assert sorted(map(str, out.rglob("*"))) == before
