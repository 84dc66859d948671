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
from supervisor.observe.redact import secret_values
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

    def test_a_traceback_carries_no_locals_and_no_secret(self, tmp_path: Path, restore_logging: None) -> None:
        """Issue 35 item 7: `supervisor_failed`'s traceback shows no frame locals, and a `[job] env` token or an
        `--api-key` value in the exception's own message is masked, in the file and on the console."""
        token, key = "hf_tOkEn_1234567", "sk-aPiKeY-7654321"
        argv = ["torchrun", "train.py", "--api-key", key]
        shown: list[str] = []
        console = type("C", (), {"tty": False, "show": lambda self, lines: shown.extend(lines)})()
        configure(tmp_path, max_bytes=2**20, backups=1, console=console,  # type: ignore[arg-type]
                  secrets=secret_values({"HF_TOKEN": token, "OMP_NUM_THREADS": "1"}, argv))

        def launch(env: dict[str, str], argv: list[str]) -> None:
            raise RuntimeError(f"cannot launch {argv} with {env}")

        try:
            launch({"HF_TOKEN": token}, argv)
        except RuntimeError as exc:
            get_logger().error("supervisor_failed", error=str(exc), exc_info=exc)
        text = (tmp_path / LOG_FILE).read_text()
        frames = json.loads(text)["exception"][0]["frames"]
        assert [f["name"] for f in frames][-1] == "launch" and all("locals" not in f for f in frames)
        assert "--api-key" in text and "***" in text
        assert token not in text + "".join(shown) and key not in text + "".join(shown), text

    def test_secret_values_are_what_the_redactor_masks(self) -> None:
        """Masked by name (env), by flag (`--api-key V`, `--hf-token=V`, `WANDB_API_KEY=V`); short values are not."""
        argv = ["x", "--api-key", "aaaa1", "--hf-token=bbbb2", "WANDB_API_KEY=cccc3", "--lr", "0.001", "--key", "k"]
        assert secret_values({"HF_TOKEN": "dddd4", "PATH": "/usr/bin"}, argv) == ["aaaa1", "bbbb2", "cccc3", "dddd4"]


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
