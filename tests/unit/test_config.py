"""job.toml loading: defaults, path resolution, and one-line errors that name the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.errors import ConfigError

MINIMAL = """
[job]
command = ["torchrun", "-m", "trainer"]
[checkpoints]
dir = "ckpts"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


class TestLoad:
    def test_defaults_and_relative_paths(self, tmp_path: Path) -> None:
        """Relative dirs resolve against the config's directory; documented defaults apply."""
        cfg = load_config(write(tmp_path, MINIMAL))
        assert cfg.checkpoints.dir == tmp_path / "ckpts"
        assert cfg.run_dir == tmp_path / ".fsdp-supervisor"
        assert cfg.job_cwd == tmp_path
        assert cfg.job.resume_args == ["--resume", "{checkpoint}"]
        assert (cfg.restart.policy, cfg.restart.max_restarts, cfg.restart.max_no_progress_restarts) == ("on-failure", 100, 3)
        assert (cfg.checkpoints.keep_last, cfg.checkpoints.partial_max_age_s) == (3, 3600)
        assert (cfg.health.hang_timeout_s, cfg.health.stop_timeout_s) == ("auto", 120)

    def test_full_example_from_the_issue(self, tmp_path: Path) -> None:
        """Every key the issue documents is accepted."""
        text = """
[job]
command = ["torchrun", "--nproc-per-node=2", "--max-restarts=0", "-m", "trainer", "--checkpoint-dir", "ckpts"]
resume_args = ["--resume", "{checkpoint}"]
cwd = "."
env = { OMP_NUM_THREADS = "1" }
[checkpoints]
dir = "ckpts"
keep_last = 3
keep_every = 0
min_free_gb = 0
partial_max_age_s = 3600
[restart]
policy = "on-failure"
max_restarts = 100
backoff_initial_s = 1
backoff_max_s = 300
backoff_multiplier = 2
reset_after_s = 600
max_no_progress_restarts = 3
quarantine_after = 2
[health]
hang_timeout_s = 0
save_timeout_s = 1800
stop_timeout_s = 120
[supervisor]
run_dir = "/abs/run"
"""
        cfg = load_config(write(tmp_path, text))
        assert cfg.job.env == {"OMP_NUM_THREADS": "1"}
        assert cfg.run_dir == Path("/abs/run")
        assert cfg.job_cwd == tmp_path


class TestErrors:
    @pytest.mark.parametrize(
        ("text", "needle"),
        [
            (MINIMAL + "[restart]\npolicy = 'sometimes'\n", "[restart.policy]"),
            (MINIMAL + "[restart]\nmax_restartz = 3\n", "[restart.max_restartz] unknown key"),
            ("bogus = 1\n" + MINIMAL, "[bogus] unknown key"),
            (MINIMAL + "bogus = 1\n", "[checkpoints.bogus] unknown key"),
            (MINIMAL + '"a\\nb" = 1\n', "[checkpoints.a\\nb] unknown key"),  # escaped: the error stays one line
            (MINIMAL.replace('dir = "ckpts"', ""), "[checkpoints.dir] required key is missing"),
            ("[checkpoints]\ndir='x'\n", "[job] section is missing"),
            (MINIMAL + "[health]\nstop_timeout_s = -1\n", "[health.stop_timeout_s]"),
            (MINIMAL + "[health]\nstop_timeout_s = inf\n", "[health.stop_timeout_s] Input should be a finite number"),
            (MINIMAL + "[restart]\nbackoff_max_s = nan\n", "[restart.backoff_max_s]"),
            (MINIMAL + "min_free_gb = inf\n", "[checkpoints.min_free_gb] Input should be a finite number"),
            (MINIMAL.replace('["torchrun", "-m", "trainer"]', "[]"), "[job.command]"),
            (MINIMAL.replace('["torchrun", "-m", "trainer"]', '"torchrun -m trainer"'), "[job.command]"),
            (MINIMAL + "[checkpoints.extra]\n", "[checkpoints.extra] unknown key"),
            ("[job\n", "invalid TOML"),
            *((MINIMAL + f"[health]\nhang_timeout_s = {v}\n", '[health.hang_timeout_s] must be "auto", 0 (off) or a')
              for v in ("-1", '"x"', "true", "nan", "inf")),
            (MINIMAL + '[notify]\nwebhook = "ftp://x"\n', "[notify.webhook]"),
            (MINIMAL + '[notify]\nevents = ["gave_up", "exploded"]\n', "[notify.events"),
        ],
    )
    def test_one_line_naming_the_key(self, tmp_path: Path, text: str, needle: str) -> None:
        """Each bad config raises ConfigError whose single line names the culprit."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, text))
        msg = str(ei.value)
        assert needle in msg and "\n" not in msg and str(tmp_path) in msg

    @pytest.mark.parametrize(
        ("text", "needle"),
        [
            (MINIMAL + "keep_lsat = 3\n", "[checkpoints.keep_lsat] unknown key (did you mean 'keep_last'?)"),
            (MINIMAL + "[heath]\nhang_timeout_s = 60\n", "[heath] unknown key (did you mean 'health'?)"),
            (MINIMAL + "[health]\nhang_timeout = 60\n",
             "[health.hang_timeout] unknown key (did you mean 'hang_timeout_s'?)"),
            (MINIMAL + 'keep_best = { metrc = "val_loss", k = 1 }\n',
             "[checkpoints.keep_best.metrc] unknown key (did you mean 'metric'?)"),  # before "metric is missing"
            (MINIMAL.replace("command", "comand"), "[job.comand] unknown key (did you mean 'command'?)"),
            (MINIMAL.replace("[checkpoints]", "[chekpoints]"), "[checkpoints] section is missing (is [chekpoints] a"),
        ],
    )
    def test_a_misspelt_key_names_the_one_meant(self, tmp_path: Path, text: str, needle: str) -> None:
        """A misspelt key or table says which one was probably meant (an unknown key is reported before the
        "required key is missing" it causes)."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, text))
        assert needle in str(ei.value), str(ei.value)

    @pytest.mark.parametrize("extra", ["[health]\nbogus = 1\n", "pth = 'x'\n"])
    def test_no_guess_for_a_key_like_no_other(self, tmp_path: Path, extra: str) -> None:
        """No guess when nothing is close, and never the loader's own `path` field, which is not a key."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, extra + MINIMAL))
        assert "unknown key" in str(ei.value) and "did you mean" not in str(ei.value), str(ei.value)

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing config file is a ConfigError naming the path."""
        with pytest.raises(ConfigError, match="not found"):
            load_config(tmp_path / "nope.toml")


def _with(job: str = "", checkpoints: str = 'dir = "ckpts"', supervisor: str = "",
          command: str = '["torchrun", "-m", "trainer"]') -> str:
    """MINIMAL with another command, lines added to [job], another [checkpoints] body, an optional [supervisor]."""
    text = f'[job]\ncommand = {command}\n{job}\n[checkpoints]\n{checkpoints}\n'
    return text + (f"[supervisor]\n{supervisor}\n" if supervisor else "")


HOSTILE = [
    (_with(command='["torchrun", "a\\u0000b"]'), "[job.command] element 1 contains a NUL byte"),
    (_with(command='[" "]'), "[job.command] the program name (first element) is empty"),
    (_with(job='resume_args = ["--resume", "{checkpoint}\\u0000"]'), "[job.resume_args] element 1 contains a NUL"),
    (_with(job='env = { "A\\u0000B" = "1" }'), "[job.env] 'A\\x00B' is not a valid variable name"),
    (_with(job='env = { "A=B" = "1" }'), "[job.env] 'A=B' is not a valid variable name"),
    (_with(job='env = { "" = "1" }'), "[job.env] '' is not a valid variable name"),
    (_with(job='env = { A = "x\\u0000y" }'), "[job.env] the value of A contains a NUL byte"),
    (_with(job='env = { TORCHELASTIC_ERROR_FILE = "/tmp/e.json" }'), "[job.env] TORCHELASTIC_ERROR_FILE is set by"),
    (_with(job='env = { FSDP_SUPERVISOR_RUN_TOKEN = "mine" }'), "[job.env] FSDP_SUPERVISOR_RUN_TOKEN is set by"),
    (_with(job='env = { FSDP_SUPERVISOR_SKIP_STEPS = "5" }'), "[job.env] FSDP_SUPERVISOR_SKIP_STEPS is set by"),
    (_with(job='cwd = "a\\u0000b"'), "[job.cwd] contains a NUL byte"),
    (_with(job='cwd = ""'), "[job.cwd] is empty"),
    (_with(checkpoints='dir = ""'), "[checkpoints.dir] is empty"),
    (_with(checkpoints='dir = "   "'), "[checkpoints.dir] is empty"),
    (_with(checkpoints='dir = "c\\u0000d"'), "[checkpoints.dir] contains a NUL byte"),
    (_with(supervisor='run_dir = ""'), "[supervisor.run_dir] is empty"),
    (_with(supervisor="log_backups = 1000000000"), "[supervisor.log_backups]"),
    (_with(checkpoints='dir = "c"\nmin_free_gb = 1e300'), "min_free_gb = 1e+300 is more than 1e+15 GiB"),
    (_with(checkpoints='dir = "."'), "[checkpoints.dir]"),
    (_with(checkpoints='dir = ".."'), "contains this config file"),
    (_with(job='cwd = "/"', checkpoints='dir = "/"'), "contains this config file"),
    (_with(job='cwd = "work/sub"', checkpoints='dir = "work"'), "contains the job's working directory"),
    (_with(checkpoints='dir = "c"', supervisor='run_dir = "c"'), "[supervisor.run_dir]"),
    (_with(checkpoints='dir = "c"', supervisor='run_dir = "c/run"'), "is inside the checkpoint root"),
    ("x = " + "[" * 100_000, "invalid TOML: nested too deeply"),
    (MINIMAL + "[restart]\nbackoff_multiplier = 1000\nmax_no_progress_restarts = 200\n",
     "[restart] backoff_multiplier = 1000 overflows within max_no_progress_restarts = 200"),
]


class TestHostileValues:
    """Strings that reach argv, the environment or the filesystem, and paths that overlap (issue 13 class 7, 11.3)."""

    @pytest.mark.parametrize(("text", "needle"), HOSTILE, ids=[needle for _, needle in HOSTILE])
    def test_one_line_naming_the_key(self, tmp_path: Path, text: str, needle: str) -> None:
        """Each hostile or careless value is one ConfigError line naming the key (never a later traceback)."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, text))
        msg = str(ei.value)
        assert needle in msg and "\n" not in msg and str(tmp_path) in msg, msg

    def test_checkpoint_root_reached_through_a_symlink(self, tmp_path: Path) -> None:
        """A root that is a symlink to the config's own folder is caught too (paths are compared resolved)."""
        (tmp_path / "conf").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "conf")
        p = tmp_path / "conf" / "job.toml"
        p.write_text(_with(checkpoints=f'dir = "{tmp_path / "link"}"'))
        with pytest.raises(ConfigError, match="contains this config file"):
            load_config(p)

    def test_run_dir_may_hold_the_checkpoint_root(self, tmp_path: Path) -> None:
        """The other nesting is fine: a run folder holding both the supervisor's files and the checkpoints."""
        cfg = load_config(write(tmp_path, _with(checkpoints='dir = "run/ckpts"', supervisor='run_dir = "run"')))
        assert (cfg.run_dir, cfg.checkpoints.dir) == (tmp_path / "run", tmp_path / "run" / "ckpts")

    def test_neighbour_with_a_common_prefix_is_not_inside(self, tmp_path: Path) -> None:
        """`ckpts2` is not inside `ckpts`: containment is by path component, not by string prefix."""
        cfg = load_config(write(tmp_path, _with(checkpoints='dir = "ckpts"', supervisor='run_dir = "ckpts2"')))
        assert cfg.run_dir == tmp_path / "ckpts2"


class TestReading:
    """The file itself: a directory, bad UTF-8, or far too large is one line, read no further than the cap."""

    def test_directory(self, tmp_path: Path) -> None:
        """A directory given as the config."""
        with pytest.raises(ConfigError, match="is a directory, not a config file"):
            load_config(tmp_path)

    def test_invalid_utf8(self, tmp_path: Path) -> None:
        """Bytes that are not UTF-8 name the offset."""
        p = tmp_path / "job.toml"
        p.write_bytes(b"[job]\ncommand = [\"\xff\"]\n")
        with pytest.raises(ConfigError, match="not UTF-8 text .byte 0xff at offset 18"):
            load_config(p)

    def test_huge_file(self, tmp_path: Path) -> None:
        """A file past the cap is refused without being parsed."""
        p = tmp_path / "job.toml"
        p.write_text(MINIMAL + "#" * (2 * 2**20))
        with pytest.raises(ConfigError, match="larger than 1024 KiB"):
            load_config(p)


def _numbers() -> list[tuple[str, str, type]]:
    """Every number a job.toml can set: (table, key, int or float), nested tables (keep_best) included."""
    from pydantic import BaseModel

    from supervisor.config import Config
    out: list[tuple[str, str, type]] = []

    def walk(model: type[BaseModel], table: str) -> None:
        for name, field in model.model_fields.items():
            kinds = [k for k in (field.annotation, *getattr(field.annotation, "__args__", ())) if isinstance(k, type)]
            sub = next((k for k in kinds if issubclass(k, BaseModel)), None)
            if sub is not None:
                walk(sub, f"{table}.{name}" if table else name)
            elif int in kinds or float in kinds:
                out.append((table, name, float if float in kinds else int))

    walk(Config, "")
    return out


class TestRanges:
    """Issue 35 item 2: an absurd number is exit 2 naming the key and its range, never a run that cannot work."""

    @pytest.mark.parametrize(("table", "key", "kind"), _numbers(), ids=[f"{t}.{k}" for t, k, _ in _numbers()])
    def test_every_number_has_an_upper_and_a_lower_bound(self, tmp_path: Path, table: str, key: str, kind: type) -> None:
        """1e300 (10**18 for a count) and -1 are refused for every duration and count, naming the key."""
        base = MINIMAL.replace('dir = "ckpts"', 'dir = "ckpts"\nkeep_best = { metric = "loss", mode = "min", k = 1 }')
        for value in ("1e300" if kind is float else str(10**18), "-1"):
            body = f"{key} = {value}\n"
            if table == "checkpoints.keep_best":
                text = base.replace(", k = 1 }", f", {key} = {value} }}")
            else:
                text = base + (body if table == "checkpoints" else f"[{table}]\n{body}")
            with pytest.raises(ConfigError, match=rf"\[{table}(\.{key})?\] .*{key}|\[{table}\.{key}\]"):
                load_config(write(tmp_path, text))

    @pytest.mark.parametrize(("text", "needle"), [
        ("[restart]\nbackoff_max_s = 1e308\n", "[restart.backoff_max_s] = 1e+308 is out of range [0, 2592000]"),
        ("retention_interval_s = 1e-300\n", "[checkpoints.retention_interval_s] = 1e-300 is out of range [0.5, 2592000]"),
        ("[health]\nstop_timeout_s = 1e300\n", "[health.stop_timeout_s] = 1e+300 is out of range [1, 2592000]"),
        ("[health]\nhang_timeout_s = 1e-9\n", "[health.hang_timeout_s] = 1e-09 is neither 0 (off) nor in range [1, "),
        ("[supervisor]\nlog_max_bytes = 1\n", "[supervisor.log_max_bytes] = 1 is out of range [4096, 1099511627776]"),
    ])
    def test_the_issues_numbers(self, tmp_path: Path, text: str, needle: str) -> None:
        """The values the outside review used: the line names the key, the value and the range."""
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, MINIMAL + text))
        assert needle in str(ei.value), str(ei.value)


@pytest.mark.parametrize(("text", "needle"), [
    ("[restart]\nbackoff_max_s = true\n", '[restart.backoff_max_s] = true is not a number'),
    ("[restart]\nmax_restarts = false\n", '[restart.max_restarts] = false is not a number'),
    ('[restart]\nmax_restarts = "30"\n', '[restart.max_restarts] = "30" is not a number'),
    ('[health]\nstop_timeout_s = "60"\n', '[health.stop_timeout_s] = "60" is not a number'),
])
def test_a_boolean_or_a_string_for_a_number_is_exit_2(tmp_path: Path, text: str, needle: str) -> None:
    """Issue 35 item 2 (outside attack): pydantic took `true` as 1 and `"30"` as 30 without a word."""
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, MINIMAL + text))
    assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


class TestPlaceholders:
    """Issue 35 item 2: a `{name}` the supervisor does not substitute is exit 2 with a did-you-mean."""

    @pytest.mark.parametrize(("args", "needle"), [
        ('["--resume-from", "{ckpt}"]', ("[job.resume_args] {ckpt} is not a placeholder (did you mean {checkpoint}?); "
                                         "known: {checkpoint}, {step}, {skip_steps}")),
        ('["--load_step={Step}"]', "{Step} is not a placeholder (did you mean {step}?)"),
        ('["--skip={skip_step}"]', "(did you mean {skip_steps}?)"),
        ('["--x", "{}"]', "{} is not a placeholder; known"),
        # substituted as is (str.replace, not str.format): a spec, a conversion or spaces reached the job verbatim
        ('["--from=step_{step:06d}"]', "{step:06d} is not a placeholder (did you mean {step}?)"),
        ('["--r", "{checkpoint!r}"]', "{checkpoint!r} is not a placeholder (did you mean {checkpoint}?)"),
        ('["--r", "{checkpoint:>10}"]', "{checkpoint:>10} is not a placeholder (did you mean {checkpoint}?)"),
        ('["--r", "{ checkpoint }"]', "{ checkpoint } is not a placeholder (did you mean {checkpoint}?)"),
        ('["--r", "{check-point}"]', "{check-point} is not a placeholder (did you mean {checkpoint}?)"),
    ])
    def test_unknown_placeholder(self, tmp_path: Path, args: str, needle: str) -> None:
        with pytest.raises(ConfigError) as ei:
            load_config(write(tmp_path, MINIMAL.replace("[checkpoints]", f"resume_args = {args}\n[checkpoints]")))
        assert needle in str(ei.value), str(ei.value)

    def test_known_placeholders_and_other_braces_pass(self, tmp_path: Path) -> None:
        """{checkpoint}, {step}, {skip_steps} and braces that are no placeholder (JSON) are accepted."""
        args = ('["--resume", "{checkpoint}", "--step={step}", "--skip", "{skip_steps}", "--cfg", "{\\"a\\": 1}", '
                '"{ \\"b\\": 2 }", "{a: 1}", "{"]')
        cfg = load_config(write(tmp_path, MINIMAL.replace("[checkpoints]", f"resume_args = {args}\n[checkpoints]")))
        assert cfg.job.resume_args[-4:] == ['{"a": 1}', '{ "b": 2 }', "{a: 1}", "{"]
