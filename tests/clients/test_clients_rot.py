"""Real Lightning and transformers checkpoints rotting below the file system (issue 34, "Done when").

Neither client writes checksums: the supervisor seals each save when a pass first sees it complete
(supervisor/checkpoints/seals.py). Here the root is an ext4 on a loop device (tests/mounts.py: root only, else
skipped); once the step-10 save is sealed, one bit of its biggest shard is flipped on the device below the file
system (size, mtime and ctime unchanged, the file's cached pages dropped), a rank is killed, and the relaunch must
come from the step-5 save: the pass before it reads step 10 against its seal and quarantines it as `corrupt`.
Each job waits after its step-10 save until the test releases it (`--hold-at`), so the kill lands before step 15.

Opt-in tier (`make test-clients`), skipped where the client is not installed.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.checkpoints.seals import seal_path
from tests.clients.harness import CLIENTS, RESTART_FAST, TORCHRUN, SupervisedClient
from tests.mounts import flip_on_device, loop_ext4  # noqa: F401
from tests.supervise import Supervisors, supervisors  # noqa: F401

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

STEPS, RUN_TIMEOUT = 15, 300


def lightning(ckpts: Path, holds: Path) -> tuple[list[str], list[str], Callable[[int], Path]]:
    pytest.importorskip("lightning", reason="real-client tier: run `make test-clients`")
    command = [*TORCHRUN, str(CLIENTS / "shims" / "lightning_cpu.py"), str(CLIENTS / "lightning_train.py"),
               "--ckpt-dir", str(ckpts), "--steps", str(STEPS), "--save-every", "5", "--step-s", "0.2",
               "--top-k", "-1", "--save-last", "link", "--hold-at", "10", "--hold-dir", str(holds)]
    return command, ["--ckpt-path", "{checkpoint}"], lambda step: ckpts / f"epoch={step // 5 - 1}-step={step}.ckpt"


def hf(ckpts: Path, holds: Path) -> tuple[list[str], list[str], Callable[[int], Path]]:
    pytest.importorskip("transformers", reason="real-client tier: run `make test-clients`")
    command = [*TORCHRUN, str(CLIENTS / "shims" / "accelerate_cpu.py"), str(CLIENTS / "hf_train.py"),
               "--output-dir", str(ckpts), "--steps", str(STEPS), "--save-every", "5", "--step-s", "0.2",
               "--hold-at", "10", "--hold-dir", str(holds)]
    return command, ["--resume_from_checkpoint", "{checkpoint}"], lambda step: ckpts / f"checkpoint-{step}"


@pytest.mark.parametrize("client", [lightning, hf], ids=["lightning", "hf"])
def test_a_sealed_save_rotten_on_the_device_is_never_resumed(
        supervisors: Supervisors, tmp_path: Path, loop_ext4: tuple[Path, str],
        client: Callable[[Path, Path], tuple[list[str], list[str], Callable[[int], Path]]]) -> None:
    where, device = loop_ext4
    ckpts, holds = where / "ckpts", tmp_path / "holds"
    holds.mkdir()
    command, resume_args, save = client(ckpts, holds)
    job = SupervisedClient(supervisors, tmp_path, command=command, resume_args=resume_args, checkpoint_dir=ckpts,
                           extra_toml="keep_last = 3\n" + RESTART_FAST)
    job.start()
    rotten = save(10)
    job.wait_for(lambda: seal_path(ckpts, rotten.name).exists() and not job.events("seal_failed"), RUN_TIMEOUT,
                 f"{rotten.name} sealed")
    sealed = json.loads(seal_path(ckpts, rotten.name).read_text())
    shards = [rotten / name for name in sealed["files"] if name.endswith(".distcp")]
    shard = max(shards, key=lambda f: f.stat().st_size)
    before, data = shard.stat(), shard.read_bytes()
    flip_on_device(device, shard, before.st_size // 2)
    after = shard.stat()
    assert shard.read_bytes() != data  # what a load would read now
    assert (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    job.kill_rank(1)
    (holds / "release-10").touch()
    assert job.wait_exit(RUN_TIMEOUT) == 0, job.tails()
    started = job.events("job_started")
    # The relaunch comes from the save before the rotten one; the rotten one is never resumed, also not by a later
    # attempt (the Trainer on gloo sometimes aborts at its exit, after its last step: one more relaunch, from 15).
    assert started[1]["argv"][-2:] == [resume_args[0], str(save(5))], job.tails()
    assert all(e["argv"][-1] != str(rotten) for e in started), job.tails()
    corrupt = [e["message"] for e in job.events("checkpoint_corrupt")]
    assert len(corrupt) == 1 and f"{shard} bytes 0-{before.st_size} do not match" in corrupt[0], corrupt
    assert json.loads((rotten / ".quarantined").read_text())["reason"].startswith(f"corrupt: {shard} bytes 0-")
