"""What "auto" hang detection sees on the reference trainer (issue 37): the gaps between training beats as the
daemon reads them (the node's file on every change, here polled every 20 ms; the rank files once a second), their
p99, the ranks' own step times, the first training gap (a first step's compile or warm-up), and the longest silence
of any source in each phase. docs/operations.md chose `hang_min_s` and `hang_factor` from it.

    python -m bench.stepgaps [STEPS] [DIR]                  # the reference trainer; prints JSON
    python -m bench.stepgaps 0 DIR -- torchrun ... script   # any job that beats through the trainer library
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from supervisor.daemon.evidence import read_beat, read_rank_beats
from supervisor.policy.ranks import RankWatch

own = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else None
args = sys.argv[1:sys.argv.index("--")] if own is not None else sys.argv[1:]
steps = int(args[0]) if args else 300
d = Path(args[1] if len(args) > 1 else tempfile.mkdtemp(prefix="stepgaps-"))
hb, hbdir = d / "heartbeat.json", d / "heartbeats"
hbdir.mkdir(parents=True, exist_ok=True)
env = {**os.environ, "FSDP_SUPERVISOR_HEARTBEAT": str(hb), "FSDP_SUPERVISOR_HEARTBEAT_DIR": str(hbdir),
       "OMP_NUM_THREADS": "1"}
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
       "--checkpoint-dir", str(d / "ckpts"), "--steps", str(steps), "--save-every", "100", "--eval-every", "100",
       "--resume", "none", "--log-every", "1000"]
p = subprocess.Popen(own or cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     cwd=Path(__file__).resolve().parents[1])
w = RankWatch()
t0 = next_rank = time.monotonic()
worst: dict[str, float] = {}  # phase -> longest silence of any source seen (train: the quantity auto scales)
step_s: list[float] = []
while p.poll() is None:
    now = time.monotonic()
    beat, _ = read_beat(hb)
    if beat is not None:
        w.see(None, beat, now)
    if now >= next_rank:
        got = read_rank_beats(hbdir)
        for r, b in got.beats.items():
            if w.see(r, b, now) and b.step_s is not None and b.phase == "train":
                step_s.append(b.step_s)
        next_rank = now + 1.0
    for s in w.sources.values():
        ph = s.beat.phase or "train"
        worst[ph] = max(worst.get(ph, 0.0), now - s.changed)
    time.sleep(0.02)
g, ss = sorted(w.gaps), sorted(step_s)


def q(xs: list[float], f: float) -> float | None:
    return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else None


print(json.dumps({"wall_s": round(time.monotonic() - t0, 1), "rc": p.returncode, "gaps_n": len(g),
                  "first_gap": w.gaps[0] if w.gaps else None,
                  "gap_p50": q(g, .5), "gap_p99": q(g, .99), "gap_max": g[-1] if g else None,
                  "step_s_p50": q(ss, .5), "step_s_p99": q(ss, .99), "step_s_max": ss[-1] if ss else None,
                  "worst_silence_by_phase": {k: round(v, 2) for k, v in worst.items()}}, indent=1))
