"""The best checkpoint by a manifest metric: status's `best_checkpoint` and retention's `keep_best`, end to end.

Torch-free: checkpoints come from `tests.jobs.dcp_files` and from a plain user script that writes
its own `manifest.json` by hand (no trainer code), run under the real `fsdp-supervisor run`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.supervise import Supervisors, cli, supervisors, write_config  # noqa: F401

USER_SCRIPT = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, REPO)  # the test package's torch-free writer
from tests.jobs.dcp_files import write_checkpoint

root = Path(sys.argv[1])
for epoch, val_loss in enumerate([3.0, 1.0, 4.0, 2.0, 5.0], start=1):
    ckpt = write_checkpoint(root, epoch, name=f"epoch_{epoch}", manifest=False)  # stands in for dcp.save
    manifest = {"format": "fsdp-supervisor/1", "step": epoch, "metrics": {"val_loss": val_loss}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    time.sleep(0.2)
"""


def test_keep_best_and_status_with_a_user_scripts_manifests(tmp_path: Path, supervisors: Supervisors) -> None:
    """keep_best val_loss/min k=2 with keep_last=1 keeps the two lowest val_loss and the newest; status names the best."""
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT.replace("REPO)", f"{str(REPO)!r})", 1))
    cfg = write_config(tmp_path, [sys.executable, str(script), "ckpts"],
                       'keep_last = 1\nkeep_best = { metric = "val_loss", mode = "min", k = 2 }\n')
    p = supervisors.start(cfg)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert sorted(c.name for c in (tmp_path / "ckpts").iterdir()) == ["epoch_2", "epoch_4", "epoch_5"]
    status = json.loads(cli("status", "-c", str(cfg), "--json").stdout)
    assert status["best_checkpoint"] == {"path": str(tmp_path / "ckpts" / "epoch_2"), "step": 2,
                                         "metric": "val_loss", "value": 1.0}
    assert "best checkpoint: step 2 val_loss 1 " in cli("status", "-c", str(cfg)).stdout
