"""Tests for supervisor.checkpoints.markers: pin and quarantine marker files."""
from __future__ import annotations

import subprocess
import sys

from supervisor.checkpoints import (
    pin,
    quarantine,
)


class TestLoadersIgnoreMarkers:
    def test_real_dcp_load_ignores_marker_files(self, tmp_path, make_checkpoint):
        """torch's dcp.load (what torchtitan and Accelerate call) reads `.metadata` and the files it names only:
        a pinned and quarantined checkpoint (real dcp.save) still loads, values intact."""
        d = make_checkpoint(tmp_path, "step-10")
        pin(d)
        quarantine(d, "test")
        script = ("import sys, warnings; warnings.filterwarnings('ignore'); import torch, "
                  "torch.distributed.checkpoint as dcp; sd = {'model': {'w': torch.zeros(16)}, 'step': 0}; "
                  "dcp.load(sd, checkpoint_id=sys.argv[1]); assert sd['model']['w'].tolist() == list(range(16)); "
                  "print('loaded', sd['step'])")
        r = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "loaded 1" in r.stdout, r.stderr
