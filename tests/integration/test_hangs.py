"""Hangs cost seconds, every rank is watched, losses are counted honestly: the real supervisor, real signals.

The SIGSTOPped rank itself (its naming, the fast kill, the kept stacks) is in test_supervisor_torchrun.py's
`test_sigstopped_worker_is_a_hang`, next to the other faults that end bit-identical to an uninterrupted run.
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from pathlib import Path

import psutil

from supervisor.contract import RANK_HEARTBEAT_DIR, parse_heartbeat
from supervisor.history.records import HISTORY_FILE, read_history
from tests.helpers import HOOKED_ENTRY, suspended
from tests.jobs.hooked_trainer import SLOW_RANK_ENV, SLOW_S_ENV
from tests.supervise import FAKEJOB, Supervisors, cli, launches, stop, supervisors, wait_for, write_config  # noqa: F401
from trainer.heartbeat import STEP_INTERVAL_S

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
TIMEOUT = 300


def run_dir(tmp_path: Path) -> Path:
    return tmp_path / ".fsdp-supervisor"


def state(tmp_path: Path) -> dict:
    try:
        return json.loads((run_dir(tmp_path) / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def events(tmp_path: Path) -> list[str]:
    try:
        lines = (run_dir(tmp_path) / "supervisor.log").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line).get("event", "") for line in lines if line.startswith("{")]


def trainer(steps: int, *extra: str) -> list[str]:
    return ["--checkpoint-dir", "ckpts", "--steps", str(steps), "--seed", "3", *extra]


TINY = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch-size", "2")


def rank_writes(path: Path, seconds: float) -> tuple[int, int, float]:
    """(rewrites of a rank's heartbeat file seen by inotify, steps it advanced, seconds watched)."""
    from watchdog.events import FileSystemEvent, FileSystemEventHandler
    from watchdog.observers import Observer

    seen: list[str] = []

    class Count(FileSystemEventHandler):
        def on_modified(self, event: FileSystemEvent) -> None:
            if str(event.src_path) == str(path):
                seen.append(str(event.src_path))

    def step() -> int:
        beat, _ = parse_heartbeat(path.read_bytes())
        return beat.step if beat is not None else 0

    observer = Observer()
    observer.schedule(Count(), str(path.parent))
    observer.start()
    try:
        first, began = step(), time.monotonic()
        time.sleep(seconds)
        last, watched = step(), time.monotonic() - began
    finally:
        observer.stop()
        observer.join()
    return len(seen), last - first, watched


class TestAutoHangDetection:
    def test_no_health_section_still_catches_a_stopped_rank(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """No [health] section (hang_timeout_s = "auto"): once the job has stepped a while, SIGSTOP of rank 1 is a
        hang after max(hang_min_s, hang_factor x p99 step time), rank 1 named, the job relaunched. Before, `status`
        says what the allowance is (no saves, so the stop cannot land in a save's allowance), and each rank's
        heartbeat is rewritten at most 4 times a second however fast it steps (trainer/heartbeat.py)."""
        cmd = [*TORCHRUN, "-m", "trainer", *trainer(10**6, "--save-every", str(10**6), *TINY)]
        p = supervisors.start(write_config(tmp_path, cmd, "[restart]\nbackoff_initial_s = 0.2\n"))
        wait_for(lambda: (state(tmp_path).get("hang_detection") or "").startswith("auto: after"), TIMEOUT,
                 "auto hang detection armed from the recent step times")
        writes, steps, window = rank_writes(run_dir(tmp_path) / RANK_HEARTBEAT_DIR / "rank-0.json", 5.0)
        assert 0 < writes <= window / STEP_INTERVAL_S + 2, (writes, steps, window)  # steps: context (~100/s idle)
        assert "hangs" in cli("status", "-c", str(tmp_path / "job.toml")).stdout
        victim = wait_for(lambda: [w for w in psutil.Process(state(tmp_path)["job_pid"]).children(recursive=True)
                                   if w.environ().get("RANK") == "1"], 30, "rank 1")[0]
        victim.suspend()
        try:
            wait_for(lambda: state(tmp_path).get("attempt") == 2, TIMEOUT, "attempt 2 after the hang")
        finally:
            with contextlib.suppress(psutil.Error):
                victim.resume()
        st = state(tmp_path)
        assert st["last_exit"]["reason"] == "hang"
        assert st["last_hang"]["ranks"] == [{"rank": 1, "why": "stopped (SIGSTOP or SIGTSTP)"}]
        rc, _ = stop(p)
        assert rc == 0


class TestOurOwnStop:
    def test_exit_0_after_our_own_sigterm_is_not_completed(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """A hung job whose SIGTERM handler exits 0: the hang kill is no completion, the run goes on (attempt 2)."""
        marker = tmp_path / "marks"
        cmd = [sys.executable, str(FAKEJOB), "--steps", "2", "--sleep", "600", "--trap-term", str(tmp_path / "t"),
               "--marker", str(marker)]
        p = supervisors.start(write_config(tmp_path, cmd, "\n[health]\nhang_timeout_s = 2\n"
                                                          "[restart]\nbackoff_initial_s = 0.2\n"))
        wait_for(lambda: len(launches(marker)) >= 2, 60, "a relaunch after the hang kill")
        assert (tmp_path / "t").exists()  # the first attempt did take our SIGTERM and exit 0
        st = state(tmp_path)
        assert st["state"] != "completed" and st["restarts"] >= 1
        rc, _ = stop(p)
        assert rc == 0 and state(tmp_path)["state"] == "stopped"
        exits = [r for r in read_history(run_dir(tmp_path) / HISTORY_FILE)[0] if r["kind"] == "attempt_exit"]
        assert exits[0]["reason"] == "hang" and exits[0]["code"] == 0


    def test_a_stop_reaches_a_stopped_agent(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """The torchrun agent is SIGSTOPped (kill -STOP, a debugger) while its workers train on: a requested stop
        still reaches it, the workers write their emergency checkpoint, and nothing waits out stop_timeout_s."""
        cfg = write_config(tmp_path, TORCHRUN + ["-m", "trainer", *trainer(10**6, "--save-every", "1000")],
                           "\n[health]\nstop_timeout_s = 30\n")
        p = supervisors.start(cfg)
        wait_for(lambda: (state(tmp_path).get("step") or 0) >= 3 and state(tmp_path).get("phase") == "train",
                 TIMEOUT, "training")
        agent = psutil.Process(state(tmp_path)["job_pid"])
        agent.suspend()
        before = state(tmp_path)["step"]
        wait_for(lambda: (state(tmp_path).get("step") or 0) > before + 3, 60, "the workers training on")
        rc, out = stop(p, timeout=120)
        assert rc == 0, out[-3000:]
        assert "job_killed" not in events(tmp_path) and list((tmp_path / "ckpts").glob("step_*")), events(tmp_path)


class TestSuspendedSupervisor:
    def test_a_suspended_supervisor_does_not_kill_a_healthy_job(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """SIGSTOP of the supervisor for 15 s (Ctrl+Z) while the job (its own session) trains on, then SIGCONT:
        the overdue hang timer reads the beats first; the job is not touched."""
        cfg = write_config(tmp_path, TORCHRUN + ["-m", "trainer", *trainer(10**6, "--save-every", "1000")],
                           "\n[health]\nhang_timeout_s = 5\n")
        p = supervisors.start(cfg)
        wait_for(lambda: (state(tmp_path).get("step") or 0) >= 3 and state(tmp_path).get("phase") == "train",
                 TIMEOUT, "training")
        before = state(tmp_path)["step"]
        job = psutil.Process(state(tmp_path)["job_pid"])
        with suspended(p):
            time.sleep(15)
        wait_for(lambda: (state(tmp_path).get("step") or 0) > before + 5, 60, "state.json catching up")
        time.sleep(2)  # anything the overdue timer would do, it has done by now
        assert "hang_detected" not in events(tmp_path) and job.is_running() and state(tmp_path)["attempt"] == 1
        rc, out = stop(p, timeout=120)
        assert rc == 0, out[-3000:]


class TestEveryRank:
    def test_a_slowed_rank_is_flagged_as_a_straggler(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """Rank 1 sleeps 0.3 s in every optimizer step: status, the history and the report name it a straggler."""
        cfg = write_config(tmp_path, [*TORCHRUN, str(HOOKED_ENTRY), *trainer(10**6, "--save-every", "1000")])
        slow = f'env = {{ OMP_NUM_THREADS = "1", {SLOW_RANK_ENV} = "1", {SLOW_S_ENV} = "0.3" }}'
        cfg.write_text(cfg.read_text().replace('env = { OMP_NUM_THREADS = "1" }', slow))
        p = supervisors.start(cfg)
        wait_for(lambda: state(tmp_path).get("stragglers") == [1], TIMEOUT, "rank 1 flagged")
        ranks = {r["rank"]: r for r in state(tmp_path)["ranks"]}
        assert ranks[1]["straggler"] and not ranks[0]["straggler"] and ranks[1]["step_s"] > 1.5 * ranks[0]["step_s"]
        status = cli("status", "-c", str(cfg))
        assert "stragglers: rank 1" in status.stdout, status.stdout
        rc, out = stop(p, timeout=120)
        assert rc == 0, out[-3000:]
        flagged = [r for r in read_history(run_dir(tmp_path) / HISTORY_FILE)[0] if r["kind"] == "straggler"]
        assert flagged[0]["rank"] == 1 and flagged[0]["flagged"] is True
        assert "straggler_detected" in events(tmp_path)


class TestStepsLost:
    def test_steps_lost_equal_the_job_s_own_log(self, tmp_path: Path, supervisors: Supervisors) -> None:
        """SIGKILL of rank 1 on a job of ~0.05 s steps: steps lost = the last step rank 0 logged minus the step
        attempt 2 resumed from, the same number in status, `report --json` and the report's last failure (the
        node's heartbeat, written once a second, lags by many steps here)."""
        cfg = write_config(tmp_path, TORCHRUN + ["-m", "trainer", *trainer(10**6, "--save-every", "10",
                                                                            "--log-every", "1")],
                           "\n[restart]\nbackoff_initial_s = 0.2\n")
        p = supervisors.start(cfg)
        wait_for(lambda: ((state(tmp_path).get("latest_checkpoint") or {}).get("step") or 0) >= 20
                 and state(tmp_path).get("phase") == "train", TIMEOUT, "a checkpoint at step 20")
        log_path = run_dir(tmp_path) / "logs" / "attempt-0001.log"

        def ahead_of_the_node_beat() -> bool:  # the kill lands where a once-a-second beat cannot know the step
            try:
                node = json.loads((run_dir(tmp_path) / "heartbeat.json").read_text())["step"]
            except (OSError, ValueError, KeyError):
                return False
            logged = re.findall(r"event=train rank=0 step=(\d+)", log_path.read_text(errors="replace"))
            return bool(logged) and 3 <= int(logged[-1]) - node <= 5 and int(logged[-1]) % 10 not in (0, 9)

        wait_for(ahead_of_the_node_beat, TIMEOUT, "rank 0 three steps past the node's heartbeat", interval=0.005)
        workers = psutil.Process(state(tmp_path)["job_pid"]).children()
        next(w for w in workers if w.environ().get("RANK") == "1").kill()
        wait_for(lambda: state(tmp_path).get("steps_lost"), TIMEOUT, "the relaunch training again")
        log = log_path.read_text(errors="replace")
        reached = int(re.findall(r"event=train rank=0 step=(\d+)", log)[-1])
        resumed = int(re.search(r"step_(\d+)", state(tmp_path)["resumed_from"])[1])
        truth = reached - resumed
        st = state(tmp_path)
        assert st["steps_lost"] == [truth], (st["steps_lost"], reached, resumed)
        assert st["last_failure"]["reached"] == reached and st["last_failure"]["resumed"] == resumed
        report = json.loads(cli("report", "-c", str(cfg), "--json").stdout)
        assert report["steps_lost"] == [truth] and report["losses"][0]["steps_lost"] == truth
        assert set(report["losses"][0]["time_lost_s"]) == {"detection", "stop", "relaunch", "worker_start", "load",
                                                          "redo"}
        rc, out = stop(p, timeout=120)
        assert rc == 0, out[-3000:]
