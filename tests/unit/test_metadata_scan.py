"""Property tests for the `.metadata` scanner: the fast path never changes an outcome, and bad bytes stay errors.

The regex fast path (metadata_records) must be invisible: on any bytes, scanning with it gives exactly what
the plain opcode loop gives (the same summary, or the same error and message). Hypothesis mutates real torch
fixtures (flips, cuts, splices, duplicated records) and also feeds opcode soup.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.checkpoints.metadata import reader as md
from supervisor.checkpoints.metadata import scan as metadata_scan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metadata"
BASES = [(FIXTURES / n).read_bytes() for n in ("py3.11.7-torch2.13.0-fsdp2.metadata",
                                                "py3.11.2-torch2.13.0-single.metadata",
                                                "py3.13.0-repro-fsdp2.metadata")]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Bytes that are opcodes the scanner knows, so soup gets past the first byte often.
_OPCODES = list(b"()0128GJKMNRbehjqrstu}]\x80\x81\x85\x86\x87\x88\x89\x8a\x8c\x8f\x90\x91\x93\x94\x95.")


def outcome(data: bytes, fast: bool) -> Any:
    try:
        return md._summarize(metadata_scan.scan(io.BytesIO(data), len(data), fast=fast))
    except md.MetadataError as exc:
        return (type(exc).__name__, str(exc))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["flip", "cut", "splice", "repeat", "insert"]))
        if how == "flip":
            data[i] = draw(st.integers(0, 255))
        elif how == "cut":
            del data[i:i + draw(st.integers(1, 64))]
        elif how == "splice":
            j = draw(st.integers(0, len(data) - 1))
            data[i:i] = data[j:j + draw(st.integers(1, 200))]
        elif how == "repeat":  # a record twice, as a hostile writer might
            data[i:i] = data[i:i + draw(st.integers(20, 300))]
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        if not data:
            break
    return bytes(data)


class TestFastPathIsExact:
    @pytest.mark.parametrize("base", range(len(BASES)))
    def test_unmutated_fixtures_agree(self, base):
        """On the real files both ways give the same summary."""
        assert outcome(BASES[base], True) == outcome(BASES[base], False)
        assert isinstance(outcome(BASES[base], True), md.DcpMetadata)

    @FUZZ
    @given(data=mutated())
    def test_mutated_fixtures_agree(self, data):
        """On mutated real files the fast path and the opcode loop agree exactly (summary or error message)."""
        assert outcome(data, True) == outcome(data, False)

    @FUZZ
    @given(data=st.lists(st.one_of(st.sampled_from(_OPCODES), st.integers(0, 255)), max_size=300))
    def test_opcode_soup_is_an_error_or_a_summary(self, data):
        """Random opcode streams end as a summary or a MetadataError (never another exception), both ways alike."""
        blob = b"\x80\x04" + bytes(data)
        assert outcome(blob, True) == outcome(blob, False)


class TestBudget:
    def test_the_budget_refuses_a_file_that_would_need_more(self, monkeypatch):
        """With a smaller memory factor a valid file is refused as hostile: the budget is really enforced."""
        data = BASES[0] * 1  # a real 9 KB file: about 4x its size is charged
        monkeypatch.setattr(metadata_scan, "MEMORY_SLACK", 0)
        monkeypatch.setattr(metadata_scan, "MEMORY_FACTOR", 1)
        with pytest.raises(md.MetadataError, match="hostile"):
            metadata_scan.scan(io.BytesIO(data), len(data))
