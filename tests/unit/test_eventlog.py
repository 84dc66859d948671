"""Tests for supervisor.observe.eventlog: where events go, under `run` and under the other commands."""
from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from supervisor.checkpoints import pin
from supervisor.observe.eventlog import LOG_FILE, configure, configure_cli, get_logger
from tests.jobs.dcp_files import write_checkpoint


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put structlog and the supervisor's stdlib logger back as they were (configure() changes both globally)."""
    try:
        yield
    finally:
        logger = logging.getLogger("supervisor")
        for handler in logger.handlers[:]:
            logger.removeHandler(handler)
            handler.close()
        structlog.reset_defaults()


class TestRun:
    def test_store_events_reach_the_log_file(self, tmp_path: Path, restore_logging: None) -> None:
        """The store logs under its module names; under `run` those events land in supervisor.log too."""
        configure(tmp_path, max_bytes=2**20, backups=1, console=False)
        get_logger().info("job_started", attempt=1)
        pin(write_checkpoint(tmp_path / "ckpts", 10))
        events = [json.loads(line)["event"] for line in (tmp_path / LOG_FILE).read_text().splitlines()]
        assert events == ["job_started", "checkpoint_pinned"]


class TestCli:
    def test_info_is_dropped_and_warnings_are_one_stderr_line(self, restore_logging: None) -> None:
        """Other commands print their own lines: the store's info events stay silent, warnings are one line."""
        configure_cli()
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            structlog.get_logger("supervisor.checkpoints.markers").info("checkpoint_pinned", path="/x")
            structlog.get_logger("supervisor.checkpoints.pruning").warning("trash_remove_failed", path="/t", error="EIO")
        assert out.getvalue() == ""
        assert err.getvalue() == "warning: trash_remove_failed path=/t error=EIO\n"
