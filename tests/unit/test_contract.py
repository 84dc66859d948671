"""The job contract: heartbeat validation (untrusted input from any script) and the manifest schema."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract import (
    MAX_HEARTBEAT_BYTES,
    MAX_STEP,
    PHASES,
    Beat,
    heartbeat_record,
    manifest_record,
    parse_heartbeat,
    parse_manifest,
    rank_heartbeat_name,
    rank_of_heartbeat,
)
from supervisor.errors import ManifestError


def beat(text: str) -> tuple[Beat | None, list[str]]:
    return parse_heartbeat(text.encode())


class TestParseHeartbeat:
    def test_a_full_beat(self) -> None:
        """Every documented field comes through as written."""
        b, problems = beat('{"step": 7, "time": 1700000000.5, "phase": "train", "loss": 1.25, "val_loss": 1.5}')
        assert b == Beat(7, 1700000000.5, "train", 1.25, 1.5) and problems == []

    @pytest.mark.parametrize("text", [
        '{"step": -1}', '{"step": 1.5}', '{"step": "7"}', '{"step": true}', '{"step": 1e999}',
        f'{{"step": {MAX_STEP + 1}}}', '{"phase": "train"}', '[1, 2]', '"step"', "not json", '{"step": NaN}',
        '{"step": Infinity}',
    ])
    def test_no_usable_step_rejects_the_beat(self, text: str) -> None:
        """Without a finite non-negative integer step (in JSON's safe range) nothing is taken from the beat."""
        b, problems = beat(text)
        assert b is None and len(problems) == 1

    @pytest.mark.parametrize("field,value", [
        ("loss", '"low"'), ("loss", "[1]"), ("val_loss", "NaN"), ("val_loss", "[1]"), ("time", "-5"), ("time", "1e300"),
        ("phase", '"warmup"'), ("phase", "3"), ("val_loss", "-" + "9" * 400), ("time", "9" * 400),
        ("step_s", "-1"), ("step_s", "NaN"), ("step_s", '"fast"'), ("step_s", "1e99"),
    ])
    def test_a_bad_field_is_dropped_with_a_note(self, field: str, value: str) -> None:
        """A non-finite, huge, negative or wrong-typed field is dropped; the step still counts (an integer loss
        beyond any float used to raise OverflowError and end the daemon)."""
        b, problems = beat(f'{{"step": 3, "{field}": {value}}}')
        assert b is not None and b.step == 3 and getattr(b, field) is None
        assert len(problems) == 1 and field in problems[0]

    @pytest.mark.parametrize("value,bad", [
        ("NaN", "nan"), ('"nan"', "nan"), ("Infinity", "inf"), ("-Infinity", "inf"), ('"-inf"', "inf"),
        ("1e999", "inf"), ("1e31", "inf"), ("9" * 400, "inf"), ('"INF"', "inf"), ("1e30", None), ("2.5", None),
        ('"Infinity"', "inf"), ('"-Infinity"', "inf"), ('"1e999"', "inf"), ('"NaN"', "nan"),
    ])
    def test_a_non_finite_loss_is_said_not_dropped(self, value: str, bad: str | None) -> None:
        """A NaN or infinite loss (a diverged run) is no usable value but is no bad beat either: `loss_bad` says it."""
        b, problems = beat(f'{{"step": 3, "loss": {value}}}')
        assert b is not None and b.loss_bad == bad and problems == []
        assert (b.loss is None) == (bad is not None)

    def test_a_rank_s_own_step_time(self) -> None:
        """`step_s` (a per-rank beat's own step time) comes through; trailing padding is no problem."""
        b, problems = beat('{"step": 9, "time": 1.0, "phase": "train", "step_s": 0.125}' + " " * 40 + "\n")
        assert b is not None and b.step_s == 0.125 and problems == []

    def test_oversized_input_is_refused_unread(self) -> None:
        """A heartbeat file larger than the cap is not parsed at all."""
        b, problems = parse_heartbeat(b'{"step": 1, "pad": "' + b"x" * MAX_HEARTBEAT_BYTES + b'"}')
        assert b is None and "bytes" in problems[0]

    def test_deep_nesting_is_not_a_crash(self) -> None:
        """A pathological value deep in an unknown key costs a rejection, not a RecursionError."""
        b, problems = parse_heartbeat(b'{"step": 1, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
        assert b is None and problems

    @given(st.dictionaries(st.sampled_from(["step", "time", "phase", "loss", "val_loss", "other"]),
                           st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
                                     st.lists(st.integers(), max_size=2))))
    def test_whatever_comes_in_what_comes_out_is_strict_json(self, raw: dict) -> None:
        """Any JSON object gives either no beat or a beat whose fields survive strict JSON (no NaN/inf)."""
        b, _ = parse_heartbeat(json.dumps(raw).encode())
        if b is not None:
            json.dumps(b.__dict__, allow_nan=False)
            assert b.phase in (None, *PHASES)


class TestHeartbeatRecord:
    def test_round_trip(self) -> None:
        """What the writer writes, the reader reads back unchanged."""
        rec = heartbeat_record(5, "eval", time=10.0, loss=2.0, val_loss=1.0)
        assert parse_heartbeat(json.dumps(rec).encode()) == (Beat(5, 10.0, "eval", 2.0, 1.0), [])
        rec = heartbeat_record(5, "load", time=10.0, checks_loads=True)
        assert parse_heartbeat(json.dumps(rec).encode()) == (Beat(5, 10.0, "load", checks_loads=True), [])

    @pytest.mark.parametrize("value", ['"true"', "1", "null", "{}"])
    def test_only_a_json_true_says_the_job_checks_its_loads(self, value: str) -> None:
        """The supervisor skips its read before a relaunch on this word only: anything but `true` is no word."""
        beat, _ = parse_heartbeat(f'{{"step": 1, "checks_loads": {value}}}'.encode())
        assert beat is not None and beat.checks_loads is False

    def test_non_finite_losses_are_strict_json(self) -> None:
        """The writer never produces NaN (JSON has none): a diverged loss is said as a word, a val_loss dropped."""
        rec = heartbeat_record(1, "train", time=0.0, loss=math.nan, val_loss=math.inf)
        assert rec["loss"] == "nan" and rec["val_loss"] is None
        assert heartbeat_record(1, "train", time=0.0, loss=-math.inf)["loss"] == "inf"
        assert heartbeat_record(1, "train", time=0.0, loss=0.0)["loss"] == 0.0
        b, _ = parse_heartbeat(json.dumps(rec, allow_nan=False).encode())
        assert b is not None and b.loss_bad == "nan"

    def test_unknown_phase_is_a_programming_error(self) -> None:
        with pytest.raises(ValueError):
            heartbeat_record(1, "warmup", time=0.0)

    @pytest.mark.parametrize(("value", "read"), [
        ("local save of step 4 failed (ENOSPC)", "local save of step 4 failed (ENOSPC)"),
        ("x" * 500, "x" * 200),  # bounded: it is shown in status
        ("two\nlines", None), ("", None), (7, None), (["ENOSPC"], None),
    ])
    def test_the_local_tier_s_failure_is_printable_and_bounded(self, value: object, read: str | None) -> None:
        """`local_tier`: why the job's node-local tier fails; anything else in that field is dropped."""
        b, problems = parse_heartbeat(json.dumps({"step": 3, "local_tier": value}).encode())
        assert b is not None and b.local_tier == read and problems == []
        if read == value:
            assert parse_heartbeat(json.dumps(heartbeat_record(3, "train", time=1.0, local_tier=read)).encode())[0] \
                == Beat(3, 1.0, "train", local_tier=read)


class TestManifestSchema:
    def test_round_trip(self) -> None:
        """manifest_record is read back by parse_manifest with the same values."""
        rec = manifest_record(step=4, world_size=2, time=1.0, torch_version="2.13.0",
                              metrics={"loss": 1.5, "val_loss": math.nan}, files={"a": 3}, sha256={"a": "ff"})
        m = parse_manifest(json.dumps(rec, allow_nan=False).encode())
        assert (m.step, m.world_size, m.loss, m.metrics, m.files, m.sha256, m.torch_version) == (
            4, 2, 1.5, {"loss": 1.5}, {"a": 3}, {"a": "ff"}, "2.13.0")

    @pytest.mark.parametrize("doc", [
        {"format": "other/1", "step": 1}, {"format": "fsdp-supervisor/1", "step": -1},
        {"format": "fsdp-supervisor/1", "step": 1, "world_size": 0},
        {"format": "fsdp-supervisor/1", "step": 1, "files": {"a": -1}},
    ])
    def test_bad_manifests_name_the_field(self, doc: dict) -> None:
        with pytest.raises(ManifestError):
            parse_manifest(json.dumps(doc).encode())


class TestRankFiles:
    @pytest.mark.parametrize(("name", "rank"), [
        ("rank-0.json", 0), ("rank-15.json", 15), ("rank-1234567.json", 1234567), ("rank-12345678.json", None),
        ("rank--1.json", None), ("rank-1.json.tmp", None), (".rank-1.json", None), ("rank-x.json", None),
        ("rank-00.json", None), ("rank-01.json", None),  # one rank, one name: a stale alias must not stand for rank 1
        ("heartbeat.json", None),
    ])
    def test_only_the_contract_s_names_are_rank_beats(self, name: str, rank: int | None) -> None:
        assert rank_of_heartbeat(name) == rank

    def test_names_round_trip(self) -> None:
        assert all(rank_of_heartbeat(rank_heartbeat_name(r)) == r for r in (0, 7, 4095))
