"""Media rot below a plain DCP script's checkpoints (issue 34, "Done when"): the supervisor's seal catches it.

The script is tests/jobs/user_dcp_script.py, after the PyTorch DCP tutorial: `dcp.save` of FSDP1's sharded state
into `epoch_<E>/`, `--resume-from PATH`, no checksums of its own and no trainer library. Its root is an ext4 on a
loop device; one bit of the newest checkpoint's biggest shard is flipped on the device below the file system
(size, mtime and ctime unchanged, the file's cached pages dropped), after the supervisor sealed that checkpoint.
The reference trainer's version of this test is tests/integration/test_supervisor_torchrun.py,
TestQuarantine.test_a_rotten_bit_is_caught_on_load_and_the_run_ends_bit_identical[device].
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.checkpoints.seals import seal_path
from tests.mounts import flip_on_device, loop_ext4  # noqa: F401
from tests.supervise import Supervisors, supervisors, wait_for, write_config  # noqa: F401

SCRIPT = Path(__file__).parents[1] / "jobs" / "user_dcp_script.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
FAST = "\n[restart]\nbackoff_initial_s = 0.2\nbackoff_max_s = 1\n[health]\nstop_timeout_s = 20\n"
TIMEOUT = 300


def events(tmp_path: Path) -> list[dict]:
    log = tmp_path / ".fsdp-supervisor" / "supervisor.log"
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def start(tmp_path: Path, supervisors: Supervisors, root: Path, ready: Path, *extra: str) -> subprocess.Popen[str]:
    """The script under the supervisor in `root` (crashing at epoch 5, held until the file `go` exists), once `ready`
    exists: the supervisor's process."""
    cmd = [*TORCHRUN, str(SCRIPT), "--ckpt-dir", str(root), "--epochs", "7", "--save-every", "2",
           "--crash-at-epoch", "5", "--hold", str(tmp_path / "go"), *extra]
    cfg = write_config(tmp_path, cmd, FAST)
    cfg.write_text(cfg.read_text().replace('"--resume"', '"--resume-from"').replace('dir = "ckpts"', f'dir = "{root}"'))
    p = supervisors.start(cfg)
    wait_for(lambda: ready.exists() or p.poll() is not None, TIMEOUT, str(ready))
    assert p.poll() is None, p.communicate()[0][-3000:]
    return p


def test_a_sealed_plain_dcp_checkpoint_rotten_on_the_device_is_never_resumed(
        tmp_path: Path, supervisors: Supervisors, loop_ext4: tuple[Path, str]) -> None:
    """epoch_0, 2, 4 saved and sealed; a bit of epoch_4 rots on the device; the script crashes at epoch 5. The pass
    before the relaunch reads epoch_4 against its seal, quarantines it as corrupt (`checkpoint_corrupt` names the
    file and range) and the script is relaunched from epoch_2, the checkpoint before the rotten one."""
    where, device = loop_ext4
    root = where / "ckpts"
    root.mkdir()
    go, record, sealed = tmp_path / "go", tmp_path / "record.txt", seal_path(root, "epoch_4")
    p = start(tmp_path, supervisors, root, sealed, "--record", str(record))
    rotten = root / "epoch_4"
    shard = max(rotten.glob("*.distcp"), key=lambda f: f.stat().st_size)
    seal = json.loads(sealed.read_text())
    assert seal["by"] == "fsdp-supervisor" and shard.name in seal["files"]
    before, data = shard.stat(), shard.read_bytes()
    flip_on_device(device, shard, before.st_size // 2)
    after = shard.stat()
    assert shard.read_bytes() != data  # read back from the device: the rot is what a load would read
    assert (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    go.touch()  # the script crashes at epoch 5
    out, _ = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 0, out[-3000:]
    assert record.read_text().splitlines() == [f"start=3 resume={root / 'epoch_2'} attempt=2"]
    evs = events(tmp_path)
    started = [e.get("resumed_from") for e in evs if e.get("event") == "job_started"]
    assert started == [None, str(root / "epoch_2")], started
    corrupt = [e["message"] for e in evs if e.get("event") == "checkpoint_corrupt"]
    assert len(corrupt) == 1 and f"{shard} bytes 0-{before.st_size} do not match" in corrupt[0], corrupt
    marker = json.loads((rotten / ".quarantined").read_text())
    assert marker["reason"].startswith(f"corrupt: {shard} bytes 0-")
    assert shard.exists()  # the verdict alone deletes nothing


def test_a_trainer_library_checkpoint_loaded_by_plain_dcp_is_read_before_its_relaunch(
        tmp_path: Path, supervisors: Supervisors, loop_ext4: tuple[Path, str]) -> None:
    """Saved with `trainer.checkpoint` (the manifest's checksums), loaded with plain `dcp.load` (checks nothing): the
    job never said its load checks (the heartbeat's `checks_loads`), so the pass before its relaunch reads the resume
    point against the manifest's checksums; a bit of step 4 rotten on the device is quarantined, step 2 resumed."""
    where, device = loop_ext4
    root = where / "ckpts"
    root.mkdir()
    go, record, rotten = tmp_path / "go", tmp_path / "record.txt", root / "step_00000004"
    p = start(tmp_path, supervisors, root, rotten / "manifest.json", "--save-with-trainer", "--record", str(record))
    assert json.loads((rotten / "manifest.json").read_text())["checksums"]
    shard = max(rotten.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = shard.read_bytes()
    flip_on_device(device, shard, shard.stat().st_size // 2)
    assert shard.read_bytes() != data
    go.touch()  # the script crashes at epoch 5
    out, _ = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 0, out[-3000:]
    assert record.read_text().splitlines() == [f"start=3 resume={root / 'step_00000002'} attempt=2"]
    corrupt = [e["message"] for e in events(tmp_path) if e.get("event") == "checkpoint_corrupt"]
    assert len(corrupt) == 1 and f"{shard} bytes" in corrupt[0], corrupt
    assert json.loads((rotten / ".quarantined").read_text())["reason"].startswith(f"corrupt: {shard} bytes")


def test_a_seals_folder_planted_by_another_uid_never_lets_a_rotten_checkpoint_through(
        tmp_path: Path, supervisors: Supervisors, loop_ext4: tuple[Path, str]) -> None:
    """Outside attack: epoch_4 sealed, a bit of it rots on the device, and the seals' folder is handed to another uid
    (anybody could have forged a seal in it). The supervisor cannot check the resume point: it never relaunches from
    it unread; it gives up (exit 3) naming the folder, a person fixes the folder."""
    where, device = loop_ext4
    root = where / "ckpts"
    root.mkdir()
    go, sealed = tmp_path / "go", seal_path(root, "epoch_4")
    p = start(tmp_path, supervisors, root, sealed)
    shard = max((root / "epoch_4").glob("*.distcp"), key=lambda f: f.stat().st_size)
    flip_on_device(device, shard, shard.stat().st_size // 2)
    os.chown(sealed.parent, 65534, 65534)
    go.touch()  # the script crashes at epoch 5
    out, _ = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 3, out[-3000:]
    evs = events(tmp_path)
    assert [e.get("resumed_from") for e in evs if e.get("event") == "job_started"] == [None]
    assert f"cannot check {root / 'epoch_4'} before the launch" in out and str(sealed.parent) in out, out[-3000:]


TITAN = Path(__file__).parents[1] / "jobs" / "titan_like.py"


@pytest.mark.parametrize("seals", ["ours", "another uid's"])
def test_a_job_that_picks_its_own_checkpoint_is_not_relaunched_onto_a_rotten_one(
        tmp_path: Path, supervisors: Supervisors, seals: str) -> None:
    """Outside attack: torchtitan's rule (`resume_args = []`: it loads the highest `step-N` with `.metadata`, and
    knows nothing of `.quarantined`). step-10 is sealed, then a bit of it rots; the job dies at step 14. The pass
    before the relaunch finds step-10 corrupt, but the job would load it anyway: the supervisor does not relaunch
    it onto the rotten checkpoint; it gives up (exit 3) naming it, as it does for a divergence of such a job."""
    dump, marker = tmp_path / "dump", tmp_path / "marks.jsonl"
    root = dump / "checkpoint"
    cmd = [sys.executable, str(TITAN), "--dump_folder", str(dump), "--training.steps", "20", "--step-s", "0.7",
           "--die-at-step", "14", "--die-attempt", "1", "--marker", str(marker)]
    cfg = write_config(tmp_path, cmd, FAST)
    cfg.write_text(cfg.read_text().replace('resume_args = ["--resume", "{checkpoint}"]', "resume_args = []")
                   .replace('dir = "ckpts"', f'dir = "{root}"'))
    p = supervisors.start(cfg)
    sealed = seal_path(root, "step-10")
    wait_for(lambda: sealed.exists() or p.poll() is not None, TIMEOUT, "the seal of step-10")
    assert p.poll() is None, p.communicate()[0][-3000:]
    shard = root / "step-10" / "__0_0.distcp"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(b"\x01")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    if seals != "ours":  # the check cannot be made: still never launched onto it
        os.chown(sealed.parent, 65534, 65534)
    out, _ = p.communicate(timeout=TIMEOUT)
    loaded = [json.loads(line)["loaded"] for line in marker.read_text().splitlines()]
    assert "step-10" not in loaded[1:], (loaded, out[-3000:])
    assert p.returncode == 3, out[-3000:]
    assert f"{root / 'step-10'}" in out and ("corrupt" in out if seals == "ours" else "fsdp-seals" in out), out[-3000:]
