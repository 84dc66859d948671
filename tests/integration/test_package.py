"""Package-wide promises: the supervisor never imports torch, the module map is current, and the distribution
installs the daemon torch-free from its wheel and supervises a job that lives in another venv."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import supervisor
from tests.supervise import write_config
from tests.unit.test_package import REPO


class TestTorchFree:
    def test_no_supervisor_module_imports_torch(self) -> None:
        """Importing every supervisor module (and building the CLI) leaves torch out of sys.modules."""
        names = sorted(m.name for m in pkgutil.walk_packages(supervisor.__path__, "supervisor.")
                       if not m.name.endswith("__main__"))
        assert "supervisor.daemon.core" in names and "supervisor.cli.checkpoints" in names
        code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
                "from supervisor.cli.app import build_parser; build_parser()\nprint('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        assert out.stdout.strip() == "False"


class TestDocs:
    def test_module_map_matches_the_tree(self) -> None:
        """docs/design.md's module map names every module of supervisor/ and trainer/, and nothing else."""
        text = (REPO / "docs" / "design.md").read_text()
        section = text[text.index("## Module map"):]
        mapped = set(re.findall(r"^\| `((?:supervisor|trainer)/[\w/]+\.py)` \|", section, re.M))
        tracked = subprocess.run(["git", "ls-files", "supervisor", "trainer"], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.split()
        on_disk = {p for p in tracked if p.endswith(".py")} or {
            str(p.relative_to(REPO)) for d in ("supervisor", "trainer") for p in (REPO / d).rglob("*.py")}
        assert mapped == on_disk, (f"missing from the map: {sorted(on_disk - mapped)}; "
                                   f"not in the tree: {sorted(mapped - on_disk)}")


# --- The distribution as an operator gets it: the wheel, installed without torch -----------------------------------

def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would make the worktree's code or this venv win over the installed wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_PROGRESS_BAR": "off", **extra}


def _build(src: Path, outdir: Path) -> str:
    """`python -m build` (the sdist, then the wheel from the sdist); without the `build` package (a venv made before
    the dev extra named it) the same two PEP 517 steps through setuptools' backend. Returns what the build said."""
    if importlib.util.find_spec("build") is not None:
        r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir), str(src)],
                           check=True, capture_output=True, text=True, timeout=300, env=_clean_env())
        return r.stdout + r.stderr
    code = ("import sys, tarfile, pathlib; from setuptools import build_meta as b; out = sys.argv[1]\n"
            "sdist = pathlib.Path(out, b.build_sdist(out)); tarfile.open(sdist).extractall('unpacked')\n"
            "import os; os.chdir(next(pathlib.Path('unpacked').iterdir())); b.build_wheel(out)")
    r = subprocess.run([sys.executable, "-c", code, str(outdir)], cwd=src, check=True, capture_output=True, text=True,
                       timeout=300, env=_clean_env())
    return r.stdout + r.stderr


@dataclass(frozen=True)
class DaemonVenv:
    dist: Path
    bin: Path
    build_log: str


@pytest.fixture(scope="session")
def daemon_venv(tmp_path_factory: pytest.TempPathFactory) -> DaemonVenv:
    """The wheel and sdist built once from the tracked files, and the wheel installed (not editable) in a fresh venv:
    its dependencies resolved by pip from the configured index, torch not among them."""
    root = tmp_path_factory.mktemp("package")
    src, dist = root / "src", root / "dist"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    build_log = _build(src, dist)
    venv = root / "daemon-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_clean_env())
    wheel = next(dist.glob("fsdp_supervisor-*.whl"))
    r = subprocess.run([str(venv / "bin" / "pip"), "install", str(wheel)], capture_output=True, text=True,
                       timeout=600, cwd=root, env=_clean_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return DaemonVenv(dist=dist, bin=venv / "bin", build_log=build_log)


class TestDaemonOnlyInstall:
    def test_wheel_and_sdist_hold_both_packages_and_the_default_install_is_torch_free(self, daemon_venv: DaemonVenv) -> None:
        """The sdist and the wheel carry supervisor/ and trainer/; the wheel's default requirements are the daemon's
        alone, torch and the trainer's libraries only under the `trainer` extra."""
        sdist = next(daemon_venv.dist.glob("fsdp_supervisor-*.tar.gz"))
        with tarfile.open(sdist) as t:
            names = t.getnames()
        assert any(n.endswith("/supervisor/daemon/core.py") for n in names)
        assert any(n.endswith("/trainer/__init__.py") for n in names) and any(n.endswith("/pyproject.toml") for n in names)
        wheel = next(daemon_venv.dist.glob("fsdp_supervisor-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            assert "supervisor/cli/app.py" in z.namelist() and "trainer/__init__.py" in z.namelist()
        requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.M)
        default = {re.split(r"[ ;<>=!\[]", r)[0].lower() for r in requires if "extra ==" not in r}
        trainer = {re.split(r"[ ;<>=!\[]", r)[0].lower() for r in requires if 'extra == "trainer"' in r}
        assert default >= {"psutil", "watchdog", "pydantic", "structlog"}
        assert not default & {"torch", "numpy", "safetensors", "tqdm"}, default
        assert {"torch", "numpy", "safetensors", "tqdm"} <= trainer, trainer

    def test_the_build_has_no_deprecation_warning(self, daemon_venv: DaemonVenv) -> None:
        """setuptools turns its deprecations into errors on a date (the `license = { text = ... }` table: builds fail
        from 2027-02-18): a build that warns today is one that breaks later without a change here."""
        warned = [line for line in daemon_venv.build_log.splitlines() if "deprecat" in line.lower()]
        assert not warned, warned

    def test_fresh_venv_has_no_torch_and_pip_check_is_clean_in_both_installs(self, daemon_venv: DaemonVenv) -> None:
        """The daemon's venv imports our installed code (not this checkout), has no torch, and `pip check` passes
        there and in the full (trainer + dev) install this suite runs in."""
        py = str(daemon_venv.bin / "python")
        code = ("import importlib.util, supervisor, trainer\n"
                "print(supervisor.__file__); print(trainer.__file__); print(importlib.util.find_spec('torch'))")
        out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                             cwd=daemon_venv.dist, env=_clean_env()).stdout.splitlines()
        site = str(daemon_venv.bin.parent)
        assert out[0].startswith(site) and out[1].startswith(site) and out[2] == "None", out
        for pip in (py, sys.executable):
            r = subprocess.run([pip, "-m", "pip", "check"], capture_output=True, text=True, timeout=120,
                               env=_clean_env())
            assert r.returncode == 0, f"{pip}: {r.stdout}{r.stderr}"

    def test_installed_cli_lists_checkpoints_and_supervises_a_job_from_another_venv(
            self, daemon_venv: DaemonVenv, tmp_path: Path, make_checkpoint: Callable[[Path, str], Path]) -> None:
        """The torch-free install's `fsdp-supervisor`: `--version`, `checkpoints list` on a real DCP checkpoint, and
        `run` of a job whose program is another venv's python (this suite's, with torch) to completion."""
        exe = str(daemon_venv.bin / "fsdp-supervisor")
        env = _clean_env()
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert (r.returncode, r.stdout.strip()) == (0, f"fsdp-supervisor {supervisor.__version__}"), r.stderr
        out = tmp_path / "job.out"
        job = (f"import sys, torch; open({str(out)!r}, 'w').write(sys.prefix + ' ' + torch.__version__ + ' '"
               " + ' '.join(sys.argv[1:]))")
        config = write_config(tmp_path, [sys.executable, "-c", job])
        make_checkpoint(tmp_path / "ckpts", "step_000010")
        r = subprocess.run([exe, "checkpoints", "list", "-c", str(config)], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env=env)
        assert r.returncode == 0 and "step_000010" in r.stdout, r.stdout + r.stderr
        r = subprocess.run([exe, "run", "-c", str(config)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        prefix, version, *args = out.read_text().split()
        assert prefix == sys.prefix and version == importlib.metadata.version("torch")
        assert args == ["--resume", str(tmp_path / "ckpts" / "step_000010")], args

    def test_readme_install_block_is_these_installs(self) -> None:
        """README's install block is what this class runs: the checkout without extras into a venv of its own (the
        wheel pip builds from it), and the full install as `make` does it (torch pinned first, then the extra)."""
        text = (REPO / "README.md").read_text()
        section = text[text.index("\n## Install\n"):]
        block = re.search(r"```sh\n(.*?)```", section[:section.index("\n## ", 1)], re.S)
        assert block is not None
        daemon, full = block.group(1).splitlines()[:2]
        assert re.match(r"python3 -m venv (\S+) && \1/bin/pip install \. ", daemon), daemon
        assert re.match(r"pip install torch==2\.13\.0 && pip install '\.\[trainer\]' ", full), full
        assert "pip install --progress-bar on torch==2.13.0" in (REPO / "Makefile").read_text()

    def test_make_unit_and_pythons_run_in_venvs_without_torch(self) -> None:
        """`make unit` and `make pythons` (3.10 and 3.13, part of `make test`) run tests/unit through tests/notorch.sh,
        which builds a venv without torch and refuses one that has it (docs/development.md)."""
        def dry(target: str) -> list[str]:  # not the parent's make (CI's `make test`): no "Entering directory"
            env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
            return subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO, capture_output=True,
                                  text=True, check=True, env=env).stdout.splitlines()
        assert dry("unit") == ["bash tests/notorch.sh python3"]
        assert "for v in 3.10 3.13; do bash tests/notorch.sh $v --mypy" in dry("pythons")[0]
        script = (REPO / "tests" / "notorch.sh").read_text()
        assert "import torch" in script and "has torch" in script
        assert re.search(r"^test: lint pythons\b", (REPO / "Makefile").read_text(), re.M)


def _fake_distribution(root: Path, name: str, version: str) -> Path:
    """A distribution `name` that installed a package `name` (what pip leaves: the package and its dist-info)."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("# someone else's package\n")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{info.name}/METADATA,,\n")
    return root


class TestImportNameClash:
    @pytest.mark.parametrize(("name", "version"), [("supervisor", "4.2.5"), ("trainer", "0.0.36")])
    def test_console_script_names_the_other_distribution_exit_2(self, daemon_venv: DaemonVenv, tmp_path: Path,
                                                                name: str, version: str) -> None:
        """supervisord's `supervisor` or Coqui's `trainer` first on sys.path: the installed `fsdp-supervisor` exits 2
        with one line naming that distribution and the fix, not an ImportError traceback (or their code)."""
        fake = _fake_distribution(tmp_path / "site", name, version)
        r = subprocess.run([str(daemon_venv.bin / "fsdp-supervisor"), "--version"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env=_clean_env(PYTHONPATH=str(fake)))
        assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        assert f"distribution {name}" in r.stderr and "venv of its own" in r.stderr, r.stderr
