"""The summary of scripted histories (tables), the HTML page (marks, escaping, nothing fetched), `report` exits."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.supervise import REPO
from tests.unit.test_report import CRASH_AND_RESUME
from tests.unit.test_report import TestCommand as ReportCommandTests  # under a name pytest does not collect again


def test_a_reader_that_leaves_is_no_traceback(tmp_path: Path) -> None:
    """`report --json | head -1`: the pipe closes early; the CLI exits 141 (SIGPIPE's code) without a traceback."""
    cfg = ReportCommandTests().history(tmp_path, CRASH_AND_RESUME)
    p = subprocess.Popen([sys.executable, "-m", "supervisor", "report", "--json", "-c", str(cfg)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the CLI has even imported: its first write fails
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and "Traceback" not in err and err == ""
