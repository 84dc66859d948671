"""Tiny hostile `.metadata` files must cost bounded time and memory: each is parsed in a subprocess under limits.

The subprocess runs `read_metadata` under RLIMIT_AS (so a memory regression dies with MemoryError instead of
eating the machine) and a timeout (so a time regression fails in seconds). Each bomb must come back as an
ordinary MetadataError, with the peak RSS it took reported and checked against a generous budget.
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO
from tests.jobs.dcp_files import storage_metadata_bytes
from tests.unit.test_metadata_bombs import BOMBS

ADDRESS_SPACE = 300 * 2**20  # the whole subprocess, interpreter included (it starts at about 25 MB)
PEAK_RSS_MB = 100  # what a bomb may cost at most (the interpreter itself is about 20 MB)
TIMEOUT_S = 60  # a kill switch, not a speed assertion: these parse in well under a second

_PROBE = r"""
import json, resource, sys, time
from pathlib import Path
from supervisor.checkpoints.metadata import reader as md
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
start = time.process_time()
try:
    md.read_metadata(Path(sys.argv[1]))
    out = {"error": None}
except md.MetadataError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
out["cpu_s"] = round(time.process_time() - start, 3)
# VmHWM, not ru_maxrss: the latter keeps the parent's high-water mark across fork + exec
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
out["peak_rss_mb"] = int(hwm.split()[1]) / 1024
print(json.dumps(out))
"""


def probe(tmp_path: Path, data: bytes) -> dict[str, Any]:
    """Parse `data` as a `.metadata` file in a limited subprocess; its outcome, CPU seconds and peak RSS."""
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    r = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(ADDRESS_SPACE)], capture_output=True,
                       text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert r.returncode == 0, f"the parse died (rc {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def _op(code: int, arg: bytes = b"") -> bytes:
    return bytes([code]) + arg


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bomb_is_refused_within_bounded_time_and_memory(tmp_path: Path, name: str) -> None:
    """Each bomb is an ordinary MetadataError, under the address-space limit, within the timeout, with small RSS."""
    data = BOMBS[name]()
    out = probe(tmp_path, data)
    assert out["error"] is not None, out
    assert out["peak_rss_mb"] < PEAK_RSS_MB, out


def test_a_real_file_passes_the_same_probe(tmp_path: Path) -> None:
    """The probe itself is sound: a valid 16-shard metadata parses under the same limits."""
    from tests.jobs.dcp_files import dcp_metadata_bytes

    out = probe(tmp_path, dcp_metadata_bytes({f"w{i}": 4096 for i in range(64)}, shards=16)[0])
    assert out["error"] is None, out


def test_no_error_message_formats_hostile_content(tmp_path: Path) -> None:
    """A refused file's message stays one short line even when the data is huge or nested (no repr)."""
    long_path = "x" * 200 + "\n" + "y" * 200
    for data in (storage_metadata_bytes([(long_path, 0, True)]), BOMBS["self-nesting dicts"](),
                 pickle.dumps({"state_dict_metadata": {}})):
        out = probe(tmp_path, data)
        assert out["error"] and len(out["message"]) < 200 and "\n" not in out["message"], out
