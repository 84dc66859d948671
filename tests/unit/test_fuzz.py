"""Bad input, fuzzed with hypothesis: job.toml, DCP `.metadata` and `manifest.json`, and a torn `state.json`.

Configs: whatever the file holds, loading it either works or raises one ConfigError line naming the file (the
CLI turns that into exit 2); a few go through the real CLI. Metadata: random and mutated bytes, also around
planted code-running pickles, are `invalid` (never an exception, never code run). state.json: prefixes of a real
one (a torn write), random bytes and wrongly typed JSON leave `status` answering with exit 0 or 1.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from supervisor.checkpoints import STATES, verify
from supervisor.checkpoints.metadata.reader import parse_metadata
from supervisor.cli import app as cli
from supervisor.config import Config, load_config
from supervisor.daemon import preflight
from supervisor.errors import ConfigError, MetadataError
from supervisor.layout import MANIFEST_NAME, METADATA_NAME
from supervisor.observe.metrics import listen_address
from supervisor.policy.state import Status
from tests.jobs.dcp_files import dcp_metadata_bytes

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- job.toml -------------------------------------------------------------------------------------------------
def _toml(v: Any) -> str:
    """A TOML literal for a value hypothesis drew (inline tables for dicts)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")) if not math.isfinite(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml, v)) + "]"
    return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + " }"


def _document(doc: dict[str, Any]) -> str:
    lines = []
    for section, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"[{json.dumps(section)}]")
            lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in body.items()]
        else:
            lines.insert(0, f"{json.dumps(section)} = {_toml(body)}")
    return "\n".join(lines) + "\n"


def _keys(section: str) -> list[str]:
    model = Config.model_fields[section].annotation
    return sorted(model.model_fields)  # type: ignore[union-attr]


_SECTIONS = ["job", "checkpoints", "restart", "health", "supervisor", "metrics"]
_text = st.text(st.characters(codec="utf-8"), max_size=12)
_scalars = st.one_of(st.booleans(), st.integers(-10, 10**6), st.integers(), st.floats(), _text,
                     st.sampled_from(["", ".", "..", "/", "~", "~nobody/x", "a\0b", "/dev/null", "127.0.0.1:0",
                                      "[::1]:0", "no-such-prog", "on-failure", "never", "{checkpoint}"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(_text, inner, max_size=3), max_leaves=6)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly the right shape (known sections and keys) with anything as values, plus strays."""
    doc: dict[str, Any] = {"job": {"command": ["no-such-prog"]}, "checkpoints": {"dir": "ckpts"}}
    for section in draw(st.lists(st.sampled_from(_SECTIONS + ["bogus"]), max_size=4, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            doc[section] = draw(_values)  # a scalar or list where a table belongs
            continue
        keys = _keys(section) + ["bogus"] if section in _SECTIONS else ["x"]
        body = doc.setdefault(section, {}) if isinstance(doc.get(section, {}), dict) else {}
        body.update(draw(st.dictionaries(st.sampled_from(keys), _values, max_size=4)))
        doc[section] = body
    for section in draw(st.lists(st.sampled_from(["job", "checkpoints"]), max_size=1)):
        del doc[section]
    return doc


def _assert_one_line(exc: ConfigError, path: Path) -> None:
    msg = str(exc)
    assert msg and "\n" not in msg and str(path.name) in msg, msg


class TestConfigFuzz:
    @FUZZ
    @given(doc=configs())
    @example(doc={"job": {"command": ["a\0b"], "cwd": "\0"}, "checkpoints": {"dir": "x\0y"}})
    @example(doc={"job": {"command": []}, "checkpoints": {"dir": "c", "keep_best": {"metric": "", "k": -1}}})
    @example(doc={"job": {"command": ["p"]}, "checkpoints": {"dir": "c"}, "metrics": {"listen": "localhost:99999"}})
    def test_any_document_loads_or_is_one_config_error_line(self, doc: dict[str, Any]) -> None:
        """A fuzzed job.toml loads, or fails with one ConfigError line naming the file; so does [metrics] listen."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "job.toml"
            path.write_text(_document(doc), encoding="utf-8")
            try:
                cfg = load_config(path)
                listen_address(cfg)
            except ConfigError as exc:
                _assert_one_line(exc, path)

    @FUZZ
    @given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
    @example(data=b"\xff\xfe[job]")
    @example(data=b"[job]\ncommand = [\"x\"]\n[checkpoints]\ndir = \"\"\"\n")
    def test_any_bytes_load_or_are_one_config_error_line(self, data: bytes) -> None:
        """Random bytes as job.toml (bad UTF-8, bad TOML, odd shapes) never raise anything but ConfigError."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "job.toml"
            path.write_bytes(data)
            try:
                load_config(path)
            except ConfigError as exc:
                _assert_one_line(exc, path)


# Nothing here may resolve outside the temporary folder unless it is refused: a run dir of "~" would be created.
_HOSTILE_PATHS = ["", " ", ".", "..", "a\0b", "afile", "afile/sub", "notexec", "adir", "adir/new/deep", "/proc/x/y",
                  "/dev/null", "ckpts", "run"]


class TestSetupFuzz:
    @settings(max_examples=80, deadline=None)
    @given(dir=st.sampled_from([*_HOSTILE_PATHS, "/"]), run_dir=st.sampled_from(_HOSTILE_PATHS),
           cwd=st.sampled_from([None, *_HOSTILE_PATHS]),
           program=st.sampled_from(["./notexec", "./adir", "adir", "true", "/bin/true", "./afile", " ", "a\0b"]),
           env=st.dictionaries(st.sampled_from(["A", "", "A=B", "A\0", "PATH", "TORCHELASTIC_ERROR_FILE"]),
                               st.sampled_from(["1", "", "x\0y", "/nonexistent"]), max_size=2))
    def test_setup_works_or_fails_with_one_line_before_creating_anything(
            self, dir: str, run_dir: str, cwd: str | None, program: str, env: dict[str, str]) -> None:
        """Hostile paths, programs and env through load_config, check_setup and make_dirs: either all of it
        works, or one ConfigError line and the folder is exactly as before."""
        with tempfile.TemporaryDirectory() as d:
            base = Path(d)
            (base / "afile").touch()
            (base / "notexec").write_text("#!/bin/sh\n")
            (base / "adir").mkdir()
            doc: dict[str, Any] = {"job": {"command": [program], "env": env}, "checkpoints": {"dir": dir},
                                   "supervisor": {"run_dir": run_dir}}
            if cwd is not None:
                doc["job"]["cwd"] = cwd
            path = base / "job.toml"
            path.write_text(_document(doc), encoding="utf-8")
            before = sorted(str(p) for p in base.rglob("*"))
            try:
                cfg = load_config(path)
                preflight.check_setup(cfg)
                preflight.make_dirs(cfg)
            except ConfigError as exc:
                _assert_one_line(exc, path)
                assert sorted(str(p) for p in base.rglob("*")) == before
            else:
                assert cfg.run_dir.is_dir() and cfg.checkpoints.dir.is_dir()


# ---- .metadata and manifest.json ------------------------------------------------------------------------------
class _Evil:
    """Pickles as `func(*args)`: what an attacker would plant in `.metadata`."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _payloads(sentinel: Path) -> list[bytes]:
    """Pickles that would create `sentinel` if anything ran them."""
    import builtins

    s = str(sentinel)
    code = f"open({s!r}, 'w').close()"
    evils = [_Evil(os.system, f"touch {s}"), _Evil(builtins.exec, code), _Evil(builtins.eval, code),
             _Evil(builtins.open, s, "w"), _Evil(subprocess.Popen, ["touch", s])]
    return [pickle.dumps(e, protocol=p) for e in evils for p in (2, 4)]


_VALID, _ = dcp_metadata_bytes({"w": 16, "b": 4}, shards=2)


@st.composite
def metadata_bytes(draw: st.DrawFn, payloads: list[bytes]) -> bytes:
    """Random bytes, or a real-shaped pickle with bytes flipped, cut, inserted, or spliced with a payload."""
    kind = draw(st.sampled_from(["random", "flip", "cut", "insert", "splice"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    data = bytearray(_VALID)
    at = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        for i in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=8)):
            data[i] = draw(st.integers(0, 255))
    elif kind == "cut":
        del data[at:at + draw(st.integers(1, len(data)))]
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=16))
    else:
        evil = draw(st.sampled_from(payloads))
        body = evil[2:-1] if evil[:1] == b"\x80" else evil[:-1]  # drop PROTO and STOP: a fragment mid-stream
        data[at:at] = body if draw(st.booleans()) else evil
    return bytes(data)


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("never") / "code-ran"


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint dir whose shards match _VALID, for verify() runs on mutated metadata."""
    d = tmp_path_factory.mktemp("fuzz") / "step_00000007"
    d.mkdir()
    _, sizes = dcp_metadata_bytes({"w": 16, "b": 4}, shards=2)
    for name, size in sizes.items():
        (d / name).write_bytes(b"\0" * size)
    return d


class TestMetadataFuzz:
    def test_the_unmutated_pickle_parses(self) -> None:
        """The mutation base is a valid DCP metadata pickle (so the mutations start from something real)."""
        assert parse_metadata(_VALID).entries == 2

    @FUZZ
    @given(data=st.data())
    def test_mutated_metadata_is_invalid_never_an_exception_or_code(self, data: st.DataObject, sentinel: Path) -> None:
        """parse_metadata on fuzzed bytes returns or raises MetadataError; nothing planted ever runs."""
        blob = data.draw(metadata_bytes(_payloads(sentinel)))
        try:
            parse_metadata(blob)
        except MetadataError as exc:
            assert str(exc)
        assert not sentinel.exists()

    @settings(max_examples=60, deadline=None)
    @given(data=st.data())
    def test_verify_classifies_fuzzed_metadata_with_a_reason(self, data: st.DataObject, sentinel: Path,
                                                             shard_dir: Path) -> None:
        """verify() of a dir with fuzzed .metadata is a Verdict (state and reason), never an exception."""
        blob = data.draw(metadata_bytes(_payloads(sentinel)))
        tmp = shard_dir / ".metadata.new"
        tmp.write_bytes(blob)
        os.replace(tmp, shard_dir / METADATA_NAME)  # a new inode: the reader's cache cannot answer from the past
        verdict = verify(shard_dir)
        assert verdict.state in STATES and (verdict.complete or verdict.reason)
        assert not sentinel.exists()

    @settings(max_examples=60, deadline=None)
    @given(manifest=st.one_of(st.binary(max_size=200), _values.map(lambda v: json.dumps(v).encode()),
                              st.fixed_dictionaries({"format": st.just("fsdp-supervisor/1"), "step": _values,
                                                     "files": _values}).map(lambda v: json.dumps(v).encode())))
    def test_verify_classifies_fuzzed_manifest(self, manifest: bytes, shard_dir: Path) -> None:
        """A fuzzed manifest.json next to good metadata: a Verdict with a reason, never an exception."""
        (shard_dir / METADATA_NAME).write_bytes(_VALID)
        (shard_dir / MANIFEST_NAME).write_bytes(manifest)
        try:
            verdict = verify(shard_dir)
        finally:
            (shard_dir / MANIFEST_NAME).unlink()
        assert verdict.state in STATES and (verdict.complete or verdict.reason)


# ---- state.json -------------------------------------------------------------------------------------------------
_REAL_STATE = Status(pid=1, job_pid=2, attempt=3, restarts=2, started_at=1.0, step=10, step_at=2.0,
                     latest_checkpoint={"path": "/c/step_00000010", "step": 10, "mtime": 3.0},
                     quarantined=["/c/step_5"], config="/x/job.toml", updated_at=4.0).to_json()
_REAL_STATE["last_exit"] = {"code": 1, "signal": None, "reason": "crash", "at": 5.0, "detail": "rank 0"}
_STATE_BYTES = json.dumps(_REAL_STATE, indent=2).encode()


@st.composite
def state_files(draw: st.DrawFn) -> bytes:
    """A torn write (prefix), random bytes, or the real document with fields of the wrong type."""
    kind = draw(st.sampled_from(["torn", "random", "retyped"]))
    if kind == "torn":
        return _STATE_BYTES[: draw(st.integers(0, len(_STATE_BYTES)))]
    if kind == "random":
        return draw(st.binary(max_size=200))
    doc = dict(_REAL_STATE)
    for key in draw(st.lists(st.sampled_from(sorted(doc) + ["extra"]), min_size=1, max_size=4)):
        doc[key] = draw(_values)
    return json.dumps(doc).encode()


def _status(config: Path, *flags: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["status", "-c", str(config), *flags])
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def status_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("status")
    (base / ".fsdp-supervisor").mkdir()
    path = base / "job.toml"
    path.write_text('[job]\ncommand = ["x"]\n[checkpoints]\ndir = "ckpts"\n')
    return path


class TestStateFuzz:
    @FUZZ
    @given(blob=state_files())
    @example(blob=b"[]")
    @example(blob=b'{"state": "bogus"}')
    def test_status_answers_whatever_state_json_holds(self, blob: bytes, status_config: Path) -> None:
        """`status` and `status --json` exit 3 (no supervisor runs here) with a message for torn, random or mistyped
        state.json."""
        (status_config.parent / ".fsdp-supervisor" / "state.json").write_bytes(blob)
        for flags in ((), ("--json",)):
            rc, text = _status(status_config, *flags)
            assert rc == 3 and text.strip(), (rc, text)
