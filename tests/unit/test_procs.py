"""Orphan identity against real processes: found by the run dir's token, never by argv or a reused pid."""
from __future__ import annotations

from pathlib import Path

from supervisor.host.identity import TOKEN_FILE, run_token


class TestRunToken:
    def test_kept_in_the_run_dir_and_restored_from_state(self, tmp_path: Path) -> None:
        """The first call makes one; later calls read it; a lost file comes back from state.json's copy."""
        token, error = run_token(tmp_path)
        assert error is None and len(token) == 32 and run_token(tmp_path) == (token, None)
        assert (tmp_path / TOKEN_FILE).stat().st_mode & 0o077 == 0
        (tmp_path / TOKEN_FILE).unlink()
        assert run_token(tmp_path, recorded=token) == (token, None)
        assert (tmp_path / TOKEN_FILE).read_text().strip() == token

    def test_unwritable_run_dir_still_gets_a_token(self, tmp_path: Path) -> None:
        """No file can be written: a token for this run anyway, and the error to log."""
        token, error = run_token(tmp_path / "missing")
        assert len(token) == 32 and error is not None and "missing" in error
