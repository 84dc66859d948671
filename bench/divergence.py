"""The divergence guard: how fast a NaN is rolled back, and that healthy training never trips it (issue 33).

Two supervised runs of the reference trainer (2 CPU ranks, the supervisor's defaults but a few steps between saves):
- `clean`: `steps` steps of healthy training; every `diverged` event in it is a false positive;
- `nan`: the same through tests/jobs/hooked_trainer.py with a NaN on the batch of step `nan_step` (bad data, which
  the rollback's skip avoids). `rollback_s`: from the supervisor's `diverged` event (the trainer writes a NaN beat
  at once, so this is the first bad beat read) to the rolled-back attempt's first training step (its own log,
  `--log-every 1`, polled every 20 ms). Its events before the NaN count as false positives too.

    python -m bench.divergence        # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import PY, REPO, Tagged, job_env, median, scratch, torchrun_argv, trainer_argv, wait_until

__all__ = ["run"]

HOOKED = REPO / "tests" / "jobs" / "hooked_trainer.py"
BATCH, WORLD, SAVE_EVERY = 8, 2, 10
TIMEOUT = 300.0


def _events(run_dir: Path, name: str) -> list[float]:
    """Wall times of the supervisor's `name` events."""
    try:
        lines = (run_dir / "supervisor.log").read_text().splitlines()
    except OSError:
        return []
    return [datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
            for e in map(json.loads, lines) if e.get("event") == name]


def _supervised(root: Path, tagged: Tagged, steps: int, env: dict[str, str], hooked: bool) -> Any:
    root.mkdir(parents=True)
    argv = trainer_argv(root / "ckpts", steps=steps, save_every=SAVE_EVERY, log_every=1)
    command = torchrun_argv() + ([str(HOOKED), *argv[2:]] if hooked else argv)
    hooks = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    config = root / "job.toml"
    config.write_text(f"[job]\ncommand = {json.dumps(command)}\ncwd = {json.dumps(str(REPO))}\n"
                      f"env = {{ {hooks} }}\n\n[checkpoints]\ndir = {json.dumps(str(root / 'ckpts'))}\n")
    return tagged.start([PY, "-m", "supervisor", "run", "-c", str(config)], log=root / "supervisor.out",
                        env=job_env(), cwd=root)


def measure_once(steps: int, nan_step: int) -> dict[str, Any]:
    root, tagged = scratch("divergence"), Tagged()
    run_dir = root / "nan" / ".fsdp-supervisor"
    try:
        clean = _supervised(root / "clean", tagged, steps, {"OMP_NUM_THREADS": "1"}, hooked=False)
        wait_until(lambda: clean.poll() is not None, TIMEOUT, "the clean run")
        false_positives = len(_events(root / "clean" / ".fsdp-supervisor", "diverged"))
        sample = (nan_step - 1) * WORLD * BATCH
        hooks = {"OMP_NUM_THREADS": "1", "FSDP_TRAINER_TEST_NAN_AT_SAMPLE": str(sample)}
        p = _supervised(root / "nan", tagged, steps, hooks, hooked=True)
        second = run_dir / "logs" / "attempt-0002.log"

        def first_step() -> float | None:
            text = second.read_text(errors="replace") if second.exists() else ""
            if "event=loaded" not in text:
                return None
            return time.time() if "event=train " in text.split("event=loaded", 1)[1] else None

        seen = wait_until(first_step, TIMEOUT, "the rolled-back attempt's first step")
        wait_until(lambda: p.poll() is not None, TIMEOUT, "the rolled-back run")
        found = _events(run_dir, "diverged")
        return {"rollback_s": round(seen - found[0], 3) if found else None, "exit": p.returncode,
                "false_positives": false_positives + max(0, len(found) - 1)}
    finally:
        tagged.close()
        shutil.rmtree(root, ignore_errors=True)


def run(repeats: int = 2, steps: int = 200, nan_step: int = 25) -> dict[str, Any]:
    """{rollback_s, rollback_s_all, false_positives, steps_checked} over `repeats` rounds."""
    rounds = [measure_once(steps, nan_step) for _ in range(repeats)]
    times = [r["rollback_s"] for r in rounds if r["rollback_s"] is not None]
    return {"rollback_s": median(times), "rollback_s_all": times,
            "false_positives": sum(r["false_positives"] for r in rounds), "steps_checked": 2 * steps * repeats,
            "exits": [r["exit"] for r in rounds]}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
