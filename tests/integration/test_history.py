"""history.jsonl: what `Core` records through a real recorder (fake time), torn lines, failing disks, thinning."""
from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.history.fold import summarize
from tests.unit.test_core import exit_job
from tests.unit.test_history import beats, kinds, make_core, records


class TestCoreRecords:
    def test_crash_resume_stop(self, tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
        """Start, train to 14 (checkpoint at 10), SIGKILL, resume from 10, train to 15, SIGTERM: every event is
        recorded in order, with the summary's exact numbers."""
        core, fake, _, _ = make_core(tmp_path)
        core.begin(None)
        beats(core, fake, range(1, 11))
        make_checkpoint(core.cfg.checkpoints.dir, "step_10")
        core.on_file_event(core.cfg.checkpoints.dir / "step_10")
        fake.advance(1, core)  # the debounced pass finds the commit
        beats(core, fake, range(11, 15))
        exit_job(core, fake, -signal.SIGKILL)
        failed_at = fake.now()
        fake.advance(0, core)  # a healthy attempt's failure: relaunch at once
        beats(core, fake, [10], phase="load")
        fake.advance(2, core)
        beats(core, fake, range(11, 16))
        core.on_signal(signal.SIGTERM)
        exit_job(core, fake, 0)
        recs = records(core)
        assert kinds(recs) == ["supervisor_start", "attempt_start", "first_beat", "first_step", "checkpoint_committed",
                               "attempt_exit", "attempt_start", "first_beat", "first_step", "attempt_exit",
                               "supervisor_end"]
        by_kind = {r["kind"]: r for r in recs}  # the last of each kind
        exits = [r for r in recs if r["kind"] == "attempt_exit"]
        assert exits[0]["reason"] == "signal" and exits[0]["signal"] == "SIGKILL" and exits[0]["max_step"] == 14
        assert exits[1]["reason"] == "stopped" and by_kind["supervisor_end"]["state"] == "stopped"
        starts = [r for r in recs if r["kind"] == "attempt_start"]
        assert starts[1]["resumed_step"] == 10 and starts[1]["resumed_from"].endswith("step_10")
        assert by_kind["checkpoint_committed"]["step"] == 10
        s = summarize(recs)
        assert (s.attempts, s.failures, s.steps_lost, s.exit_reasons) == (2, 1, [4], {"signal": 1, "stopped": 1})
        first = [r for r in recs if r["kind"] == "first_step"][1]
        assert s.restart_latency_s == [pytest.approx(first["t"] - failed_at)] and first["step"] == 11
        # attempt 1 trained 13 s (beats 1..14 a second apart) for 14 steps, 4 of them redone; attempt 2 4 s.
        assert s.productive_s == pytest.approx(13 + 4 - 4 * 13 / 14, abs=1e-3)
        assert s.wall_s == pytest.approx(recs[-1]["t"] - recs[0]["t"]) and 0 < s.goodput < 1
        st = json.loads((core.run_dir / "state.json").read_text())
        assert st["goodput"] == pytest.approx(s.goodput, abs=1e-4) and st["steps_lost"] == [4]
        assert st["loss_recent"][-1] == pytest.approx(10 / 16, rel=1e-5) and len(st["restart_latency_s"]) == 1

    def test_quarantine_recorded(self, tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
        """Two attempts dying while loading the newest checkpoint (heartbeat phase load) record its quarantine."""
        core, fake, _, _ = make_core(tmp_path)
        for name in ("step_10", "step_20"):
            make_checkpoint(core.cfg.checkpoints.dir, name)
        core.begin(None)
        for _ in range(2):
            beats(core, fake, range(20, 21), phase="load")
            exit_job(core, fake, 1)
            fake.advance(10, core)
        q = [r for r in records(core) if r["kind"] == "quarantined"]
        assert len(q) == 1 and q[0]["path"].endswith("step_20") and "consecutive" in q[0]["reason"]
