"""The README's walkthrough, run as written: train, Ctrl+C, resume, pick the best model, load it, export.

The commands come from the README's fenced `sh` and `python` blocks, so the test fails when the README and
reality drift. One shared run (deploy/examples/best.toml, copied next to a scratch cwd so its relative paths
land in tmp) serves every test; the tests then check what each step promised.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from supervisor.layout import MANIFEST_NAME, step_dir_name
from tests.helpers import REPO, TAG_ENV, wait_for
from tests.supervise import Supervisors, assert_no_orphans

SECTION = "## Quick start: the tutorial's workflow, supervised"
DAY2 = "## Day 2"
CONFIG = "deploy/examples/best.toml"
TIMEOUT = 240
STEPS = 40


def readme_blocks(title: str = SECTION, langs: tuple[str, ...] = ("sh", "python")) -> list[tuple[str, str]]:
    """(language, code) of every block of those languages in one README section (output blocks excluded)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(title):]
    section = section[: section.index("\n## ", len(title))]
    return [(lang, code) for lang, code in re.findall(r"```(\w*)\n(.*?)```", section, re.S) if lang in langs]


# What each block must be, in order: (language, pattern of its code).
STEPS_EXPECTED = [
    ("sh", rf"fsdp-supervisor run -c {CONFIG}\n"),
    ("sh", rf"fsdp-supervisor run -c {CONFIG}\n"),
    ("sh", rf"fsdp-supervisor logs -c {CONFIG} --job \| grep .*\n"),
    ("sh", r"cat \S+/best\.json\nfsdp-supervisor checkpoints list -c \S+\nfsdp-supervisor status -c \S+\n"),
    ("python", r".*load_file\(.*"),
    ("sh", r"python -m trainer\.export \S+ \S+\.safetensors.*\n"),
]


@dataclass
class Walkthrough:
    cwd: Path
    blocks: list[tuple[str, str]]
    outputs: list[subprocess.CompletedProcess[str] | None] = field(default_factory=list)
    stopped_at: int | None = None  # the step the trainer stopped at on Ctrl+C
    after_stop: dict[int, dict] = field(default_factory=dict)  # manifests right after the first run, by step

    day2: list[subprocess.CompletedProcess[str]] = field(default_factory=list)  # one per Day 2 command

    @property
    def examples(self) -> Path:
        return self.cwd / "deploy" / "examples"

    def attempt_log(self, n: int) -> str:
        return (self.examples / "best" / ".fsdp-supervisor" / "logs" / f"attempt-{n:04d}.log").read_text()


def _env(tag: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the venv's tools first
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", TAG_ENV: tag}


def _manifests(root: Path) -> dict[int, dict]:
    out = {}
    for path in root.glob("step_*"):
        if (path / MANIFEST_NAME).exists():
            out[int(path.name.split("_")[1])] = json.loads((path / MANIFEST_NAME).read_text())
    return out


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Walkthrough]:
    """Run every README block in order in a scratch cwd; Ctrl+C (SIGINT) the first `run` mid-training."""
    cwd = tmp_path_factory.mktemp("walkthrough")
    (cwd / "deploy" / "examples").mkdir(parents=True)
    shutil.copy(REPO / CONFIG, cwd / CONFIG)
    w = Walkthrough(cwd, readme_blocks())
    sup = Supervisors()
    env = _env(sup.tag)

    def start(code: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(shlex.split(code), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        sup.procs.append(p)
        return p

    def finish(p: subprocess.Popen[str], args: str) -> subprocess.CompletedProcess[str]:
        out, _ = p.communicate(timeout=TIMEOUT)
        return subprocess.CompletedProcess(args, p.returncode, out, "")

    def train_and_interrupt(code: str) -> subprocess.CompletedProcess[str]:
        p = start(code)
        log = w.examples / "best" / ".fsdp-supervisor" / "logs" / "attempt-0001.log"

        def training_past_15() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"run exited early: {p.communicate()[0][-3000:]}")
            return log.exists() and re.search(r"event=train rank=0 step=(1[5-9]|[2-9]\d)", log.read_text()) is not None

        wait_for(training_past_15, TIMEOUT, "training past step 15")
        p.send_signal(signal.SIGINT)  # what Ctrl+C in the supervisor's terminal sends
        done = finish(p, code)
        stopped = re.findall(r"event=stopped rank=0 step=(\d+)", w.attempt_log(1))
        w.stopped_at = int(stopped[0]) if stopped else None
        w.after_stop = _manifests(w.examples / "best" / "ckpts")
        return done

    def shell(code: str) -> subprocess.CompletedProcess[str]:
        return finish(start_shell(code), code)

    def start_shell(code: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sup.procs.append(p)
        return p

    def python(code: str) -> subprocess.CompletedProcess[str]:
        script = cwd / "inference.py"
        script.write_text(code)
        return shell(f"python {script.name}")

    actions: list[Callable[[str], subprocess.CompletedProcess[str]]] = [
        train_and_interrupt, shell, shell, shell, python, shell]
    try:
        if len(w.blocks) == len(STEPS_EXPECTED) and all(
                lang == want and re.fullmatch(pattern, code, re.S)
                for (lang, code), (want, pattern) in zip(w.blocks, STEPS_EXPECTED)):
            for (_, code), action in zip(w.blocks, actions):
                w.outputs.append(action(code))
            # README's "Day 2" commands, one by one, on what the walkthrough left behind.
            for _, code in readme_blocks(DAY2, ("sh",)):
                w.day2 += [shell(line) for line in code.splitlines() if line.strip()]
        yield w
    finally:
        sup.cleanup()
        assert_no_orphans(sup.tag)


def output(w: Walkthrough, i: int) -> subprocess.CompletedProcess[str]:
    assert len(w.outputs) > i, "the README's walkthrough blocks do not match STEPS_EXPECTED (see the first test)"
    result = w.outputs[i]
    assert result is not None
    return result


def test_readme_has_the_walkthrough_blocks(walkthrough) -> None:
    """The section's commands are, in order: run, run, logs|grep, cat/list/status, a python snippet, export."""
    got = [(lang, code) for lang, code in walkthrough.blocks]
    assert len(got) == len(STEPS_EXPECTED), got
    for (lang, code), (want, pattern) in zip(got, STEPS_EXPECTED):
        assert lang == want and re.fullmatch(pattern, code, re.S), (code, pattern)


def test_ctrl_c_stops_with_an_emergency_checkpoint(walkthrough) -> None:
    """Ctrl+C: exit 0, the trainer stops at one step and saves it; only an evaluated step's save has a val_loss
    (an emergency save's weights were never evaluated: keep_best must not count the last evaluation twice)."""
    w = walkthrough
    first = output(w, 0)
    assert first.returncode == 0, first.stdout[-3000:]
    step = w.stopped_at
    assert step is not None and 15 <= step < STEPS and step in w.after_stop, (step, sorted(w.after_stop))
    latest_eval = step - step % 10
    assert "val_loss" in w.after_stop[latest_eval]["metrics"]
    assert ("val_loss" in w.after_stop[step]["metrics"]) == (step == latest_eval), w.after_stop[step]


def test_resume_continues_where_it_stopped(walkthrough) -> None:
    """The second run resumes from the stop step ("resuming ... step=N"), the loss goes on, and it completes."""
    w = walkthrough
    second, grep = output(w, 1), output(w, 2)
    assert second.returncode == 0, second.stdout[-3000:]
    assert grep.returncode == 0, grep.stdout
    ckpt = w.examples / "best" / "ckpts" / step_dir_name(w.stopped_at or 0)
    assert re.search(rf"event=resuming rank=0 path={re.escape(str(ckpt))} step={w.stopped_at} ", grep.stdout), grep.stdout
    before = [float(x) for x in re.findall(r"event=train rank=0 step=\d+ loss=(\S+)", w.attempt_log(1))]
    after = [float(x) for x in re.findall(r"event=train rank=0 step=\d+ loss=(\S+)", grep.stdout)]
    assert after and after[0] < before[0] - 0.5 and abs(after[0] - before[-1]) < 0.5, (before, after)
    assert f"event=finished rank=0 step={STEPS} " in w.attempt_log(2)


def test_best_model_retention_and_status(walkthrough) -> None:
    """best.json names the lowest val_loss; keep_best kept it and the runner-up, keep_last the newest; status shows it."""
    import torch
    from safetensors.torch import load_file

    from trainer.export import load_model_weights

    w = walkthrough
    shown = output(w, 3)
    assert shown.returncode == 3, shown.stdout  # the block ends with `status`: 3, no supervisor is running
    evals = {int(s): float(v) for n in (1, 2)
             for s, v in re.findall(r"event=evaluated rank=0 step=(\d+) val_loss=(\S+)", w.attempt_log(n))}
    recorded = dict(evals)
    if w.stopped_at not in evals:  # the emergency save repeats the evaluation before it
        recorded[w.stopped_at] = evals[w.stopped_at - w.stopped_at % 10]  # type: ignore[operator]
    lowest = min(evals, key=lambda s: (evals[s], -s))
    best = json.loads((w.examples / "best" / "ckpts" / "best" / "best.json").read_text())
    assert best == {"step": lowest, "val_loss": evals[lowest],
                    "checkpoint": str(w.examples / "best" / "ckpts" / step_dir_name(lowest))}, evals
    kept = sorted(recorded, key=lambda s: (recorded[s], -s))[:2]
    steps = sorted(int(p.name.split("_")[1]) for p in (w.examples / "best" / "ckpts").glob("step_*"))
    assert steps == sorted({*kept, STEPS}), (steps, recorded)
    exported = load_file(w.examples / "best" / "ckpts" / "best" / "model.safetensors")
    saved = load_model_weights(best["checkpoint"])
    assert all(torch.equal(exported[k], saved[k]) for k in saved) and exported.keys() == saved.keys()
    assert '"val_loss"' in shown.stdout and re.search(r"\nbest +- +export ", shown.stdout), shown.stdout
    assert re.search(r"\nNAME +STEP +STATE +VAL_LOSS ", shown.stdout), "keep_best's metric is a column"
    assert f"best checkpoint: step {lowest} val_loss {evals[lowest]:.4g} " in shown.stdout, shown.stdout


def test_inference_snippet_loads_the_best_model(walkthrough) -> None:
    """The README's plain-PyTorch snippet runs and prints the best step."""
    w = walkthrough
    ran = output(w, 4)
    best = json.loads((w.examples / "best" / "ckpts" / "best" / "best.json").read_text())
    assert ran.returncode == 0 and f"step {best['step']}, val_loss " in ran.stdout, ran.stdout


def test_export_writes_bfloat16_safetensors(walkthrough) -> None:
    """The export command writes the final checkpoint as bf16 safetensors."""
    import torch
    from safetensors.torch import load_file

    w = walkthrough
    ran = output(w, 5)
    assert ran.returncode == 0, ran.stdout
    weights = load_file(w.cwd / "model.safetensors")
    assert weights and {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_day_two_commands_work_on_the_finished_run(walkthrough) -> None:
    """Every command of README's "Day 2" block exits 0 on the walkthrough's run (`status` 3: none is running, as
    systemctl says) and does what the README says."""
    w = walkthrough
    assert len(w.outputs) == len(STEPS_EXPECTED), "the walkthrough did not run"
    ran = {r.args.split(" -")[0].replace("fsdp-supervisor ", ""): r for r in w.day2}
    want = {r.args: 3 if r.args.startswith("fsdp-supervisor status") else 0 for r in w.day2}
    assert len(w.day2) >= 7 and all(r.returncode == want[r.args] for r in w.day2), [
        (r.args, r.returncode, r.stdout[-500:]) for r in w.day2 if r.returncode != want[r.args]]
    status = json.loads(ran["status"].stdout)
    assert status["state"] == "completed" and status["supervisor_running"] is False
    assert status["best_checkpoint"]["metric"] == "val_loss" and 0 < status["goodput"] < 1
    assert "job_exited" in ran["logs"].stdout
    assert (w.cwd / "report.html").stat().st_size > 1000 and "<svg" in (w.cwd / "report.html").read_text()
    assert ": complete" in ran["checkpoints verify deploy/examples/best/ckpts/step_00000040"].stdout
    assert (w.examples / "best" / "ckpts" / step_dir_name(STEPS) / ".pinned").exists()
    assert "no supervisor is running" in ran["stop"].stdout
