"""A corruption campaign (issue 34): faults injected into real checkpoints, none of them may be resumed.

Real checkpoints are written once, by torchrun with 2 gloo ranks: the reference trainer's (`step_<N>/`, its
manifest's xxh3 ranges written while saving) and a plain DCP script's (tests/jobs/user_dcp_script.py, after the
PyTorch tutorial: `epoch_<E>/`, no checksums of its own; each checkpoint sealed by the supervisor before the fault,
as a pass seals it when it first sees it complete). Each fault goes into a fresh copy of the root, into its newest
checkpoint, and the copy is judged by the calls the daemon's housekeeping pass makes before a launch
(`checkpoints.scan`, then `daemon.integrity.good_ones` with `verify`: supervisor/daemon/housekeeping.py):

- `caught`: the faulted checkpoint is not the resume point; `resumed`: it is (the goal: 0);
  `to_previous`: the resume point is the checkpoint before it; `by`: the state the pass gave the faulted one
  (`corrupt`: its bytes failed their checksums; `partial`, `torn`, `invalid`: not even complete).
- kinds: `bit_flip` (one bit of a random byte of a random file, its mtime put back as media rot leaves it),
  `zero_page` (a random 4 KiB-aligned page of a random file zeroed, mtime put back; a page already zero is
  redrawn), `truncate` (a random file cut to a random shorter length), `shard_swap` (a `.distcp` of the checkpoint
  before copied over the same file), `metadata_swap` (the `.metadata` of the checkpoint before copied over).

A few faults also go through a real `fsdp-supervisor run` (`relaunch`): the job (this module's `job`, no torch)
injects the fault into the checkpoint it was launched from and fails; the supervisor's pass before the relaunch
finds it and relaunches from the one before. Times from the supervisor's log: the job's exit -> `checkpoint_corrupt`
(detection), `checkpoint_corrupt` -> `job_started` (relaunch), and exit -> relaunch in all.

    python -m bench.campaign             # prints the result of run() as JSON
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import PY, REPO, median, scratch

__all__ = ["run", "inject", "KINDS"]

KINDS = ("bit_flip", "zero_page", "truncate", "shard_swap", "metadata_swap")
PER_LAYOUT = {"bit_flip": 200, "zero_page": 150, "truncate": 100, "shard_swap": 25, "metadata_swap": 25}
PAGE = 4096
_MARKERS = (".quarantined", ".pinned")
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name not in _MARKERS)


def _keep_times(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def inject(kind: str, ckpt: Path, before: Path, rng: random.Random) -> str | None:
    """Put one fault of `kind` into checkpoint `ckpt` (`before`: the checkpoint of an earlier step); what was done,
    or None when this checkpoint offers no such fault (nothing would change)."""
    if kind in ("shard_swap", "metadata_swap"):
        names = [p.name for p in ckpt.glob("*.distcp")] if kind == "shard_swap" else [".metadata"]
        name = rng.choice(sorted(names))
        other = before / name
        if not other.exists() or other.read_bytes() == (ckpt / name).read_bytes():
            return None
        shutil.copyfile(other, ckpt / name)
        return f"{name} from {before.name}"
    candidates = [f for f in _files(ckpt) if f.stat().st_size > 0]
    target = rng.choice(candidates)
    st = target.stat()
    rel = target.relative_to(ckpt)
    if kind == "truncate":
        size = rng.randrange(0, st.st_size)
        os.truncate(target, size)
        return f"{rel} cut to {size} of {st.st_size} bytes"
    with open(target, "r+b") as f:
        if kind == "bit_flip":
            at = rng.randrange(st.st_size)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
            done = f"{rel} byte {at} bit flipped"
        else:
            pages = list(range(0, st.st_size, PAGE))
            rng.shuffle(pages)
            for at in pages:
                f.seek(at)
                if any(f.read(PAGE)):
                    break
            else:
                return None
            f.seek(at)
            f.write(bytes(min(PAGE, st.st_size - at)))
            done = f"{rel} page at {at} zeroed"
    _keep_times(target, st)
    return done


def judge(root: Path) -> tuple[Path | None, dict[str, Any]]:
    """(the resume point a launch would get, {name: state}) by the housekeeping pass's own calls."""
    from supervisor import checkpoints as store
    from supervisor.daemon.integrity import good_ones, seals_idle

    found = store.merged(store.scan(root, verify_all=True), [])
    usable = [c for c in found if c.complete and not c.quarantined]
    found, usable, _ = good_ones(found, usable, verify=True, roots=(root, None), seal_new=True)
    seals_idle(60)
    return (usable[0].path if usable else None), {c.path.name: str(c.state) for c in found}


def _steps(root: Path) -> list[Path]:
    """The root's checkpoints, oldest first (by the number in their names)."""
    return sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: int(p.name.rsplit("_", 1)[1]))


def build(out: Path) -> dict[str, Path]:
    """The two layouts' roots, three checkpoints each, written by real 2-rank torchrun jobs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    roots = {"trainer": out / "trainer" / "ckpts", "plain_dcp": out / "plain_dcp" / "ckpts"}
    jobs = {"trainer": [*TORCHRUN, "-m", "trainer", "--checkpoint-dir", str(roots["trainer"]), "--steps", "15",
                        "--save-every", "5", "--seed", "3", "--resume", "none", "--log-every", "5"],
            "plain_dcp": [*TORCHRUN, str(REPO / "tests" / "jobs" / "user_dcp_script.py"), "--ckpt-dir",
                          str(roots["plain_dcp"]), "--epochs", "5", "--save-every", "2"]}
    from supervisor.checkpoints import scan

    for layout, cmd in jobs.items():
        roots[layout].mkdir(parents=True)
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        # Judged by what it wrote: now and then a rank of the FSDP1/gloo script aborts in torch's teardown after its
        # last save (tests/integration/test_supervisor_torchrun.py, TestUserScript), which costs nothing here.
        if sum(c.complete for c in scan(roots[layout])) != 3:
            raise RuntimeError(f"{layout} checkpoints: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return roots


def _copy(pristine: Path, where: Path, sealed: bool) -> Path:
    from supervisor.checkpoints.seals import seal

    root = where / "ckpts"
    shutil.copytree(pristine, root)
    if sealed:  # as the supervisor's passes sealed each when they first saw it complete
        for ckpt in _steps(root):
            seal(root, ckpt, mb_s=None)
    return root


def campaign(roots: dict[str, Path], work: Path, per_layout: dict[str, int], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    for layout, pristine in roots.items():
        sealed = layout == "plain_dcp"
        kinds: dict[str, Any] = {}
        for kind, n in per_layout.items():
            tally: Counter[str] = Counter()
            by: Counter[str] = Counter()
            escaped: list[str] = []
            judged_s: list[float] = []
            for i in range(n):
                where = work / f"{layout}-{kind}-{i}"
                root = _copy(pristine, where, sealed)
                *_, previous, newest = _steps(root)
                what = inject(kind, newest, previous, rng)
                if what is None:
                    tally["no_such_fault"] += 1
                    shutil.rmtree(where)
                    continue
                started = time.perf_counter()
                resume, states = judge(root)
                judged_s.append(time.perf_counter() - started)
                tally["faults"] += 1
                tally["caught"] += resume != newest
                tally["resumed"] += resume == newest
                tally["to_previous"] += resume == previous
                by[states[newest.name]] += 1
                if resume == newest:
                    escaped.append(what)
                shutil.rmtree(where)
            kinds[kind] = {**{k: tally[k] for k in ("faults", "caught", "resumed", "to_previous")},
                           "no_such_fault": tally["no_such_fault"], "by": dict(by), "escaped": escaped[:10],
                           "judge_ms_median": round(1000 * (median(judged_s, 6) or 0), 2)}
        out[layout] = {"sealed": sealed, "kinds": kinds}
    return out


# ---- the real relaunch: a job (no torch) that rots its own resume point and fails ------------------------

def job(argv: list[str]) -> int:
    """`python -m bench.campaign job KIND SEED RECORD --resume PATH`: on the first attempt put a KIND fault into
    PATH (the supervisor's resume point) and exit 1; after that record the resume point and exit 0."""
    kind, seed, record = argv[0], int(argv[1]), Path(argv[2])
    resume = Path(argv[argv.index("--resume") + 1]) if "--resume" in argv else None
    if os.environ.get("FSDP_SUPERVISOR_ATTEMPT") == "1":
        assert resume is not None
        before = _steps(resume.parent)[-2]
        what = inject(kind, resume, before, random.Random(seed))
        record.write_text(json.dumps({"fault": what, "rotten": str(resume), "before": str(before)}) + "\n")
        return 1
    with open(record, "a") as f:
        f.write(json.dumps({"resumed": str(resume)}) + "\n")
    return 0


def _ts(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["ts"]).replace("Z", "+00:00")).timestamp()


def relaunch(roots: dict[str, Path], work: Path, per_layout: int, seed: int) -> dict[str, Any]:
    kinds = ("bit_flip", "zero_page", "truncate", "shard_swap", "metadata_swap")
    rows, detect, relaunched, total = [], [], [], []
    n = 0
    for layout, pristine in roots.items():
        for i in range(per_layout):
            kind = kinds[n % len(kinds)]
            where = work / f"run-{layout}-{i}"
            root = _copy(pristine, where, sealed=layout == "plain_dcp")
            record = where / "record.jsonl"
            cfg = where / "job.toml"
            cfg.write_text(
                f"[job]\ncommand = {json.dumps([PY, '-m', 'bench.campaign', 'job', kind, str(seed + n), str(record)])}\n"
                f"resume_args = [\"--resume\", \"{{checkpoint}}\"]\nenv = {{ PYTHONPATH = {json.dumps(str(REPO))} }}\n\n"
                f"[checkpoints]\ndir = {json.dumps(str(root))}\nprune = false\n\n"
                "[restart]\nbackoff_initial_s = 0\nbackoff_max_s = 1\n")
            n += 1
            r = subprocess.run([PY, "-m", "supervisor", "run", "-c", str(cfg)], cwd=REPO, capture_output=True,
                               text=True, timeout=300)
            lines = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
            log = where / ".fsdp-supervisor" / "supervisor.log"
            events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")] if log.exists() else []
            exited = [e for e in events if e.get("event") == "job_exited"]
            corrupt = [e for e in events if e.get("event") == "checkpoint_corrupt"]
            started = [e for e in events if e.get("event") == "job_started"]
            row: dict[str, Any] = {"layout": layout, "kind": kind, "rc": r.returncode,
                                   "fault": lines[0].get("fault") if lines else None}
            if len(lines) == 2 and len(started) >= 2 and exited:
                rotten, before = Path(lines[0]["rotten"]), Path(lines[0]["before"])
                resumed = Path(lines[1]["resumed"])
                row |= {"resumed_rotten": resumed == rotten, "to_previous": resumed == before,
                        "caught_by": "pass" if corrupt else "completeness"}
                end, back = _ts(exited[0]), _ts(started[1])
                found = _ts(corrupt[0]) if corrupt else None
                row |= {"exit_to_relaunch_s": round(back - end, 3),
                        "exit_to_detection_s": round(found - end, 3) if found else None,
                        "detection_to_relaunch_s": round(back - found, 3) if found else None}
                total.append(back - end)
                if found:
                    detect.append(found - end)
                    relaunched.append(back - found)
            else:
                row["output"] = (r.stdout + r.stderr)[-1500:]
            rows.append(row)
            shutil.rmtree(where, ignore_errors=True)
    return {"runs": rows, "resumed": sum(bool(r.get("resumed_rotten")) for r in rows),
            "to_previous": sum(bool(r.get("to_previous")) for r in rows),
            "exit_to_detection_s": median(detect), "detection_to_relaunch_s": median(relaunched),
            "exit_to_relaunch_s": median(total), "exit_to_relaunch_s_max": round(max(total), 3) if total else None}


def run(scale: float = 1.0, relaunches: int = 5, seed: int = 34) -> dict[str, Any]:
    """`scale` multiplies the faults per kind (1.0: 500 per layout, 1,000 in all); `relaunches` per layout."""
    import structlog

    tmp = scratch("campaign")
    config = structlog.get_config()  # the store's checkpoint_quarantined warning, once a fault: not on the console
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        started = time.perf_counter()
        roots = build(tmp / "pristine")
        built = time.perf_counter() - started
        per = {k: max(1, round(n * scale)) for k, n in PER_LAYOUT.items()}
        started = time.perf_counter()
        layouts = campaign(roots, tmp / "work", per, seed)
        spent = time.perf_counter() - started
        real = relaunch(roots, tmp / "work", relaunches, seed) if relaunches else {}
    finally:
        structlog.configure(**config)
        shutil.rmtree(tmp, ignore_errors=True)
    kinds = [k for lay in layouts.values() for k in lay["kinds"].values()]
    faults, caught = sum(k["faults"] for k in kinds), sum(k["caught"] for k in kinds)
    per_kind = {name: {key: sum(lay["kinds"][name][key] for lay in layouts.values())
                       for key in ("faults", "caught", "resumed", "to_previous")} for name in per}
    return {"faults": faults, "caught": caught, "caught_pct": round(100 * caught / faults, 3) if faults else None,
            "resumed": sum(k["resumed"] for k in kinds), "to_previous": sum(k["to_previous"] for k in kinds),
            "per_kind": per_kind, "layouts": layouts, "relaunch": real, "build_s": round(built, 1),
            "campaign_s": round(spent, 1), "seed": seed}


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        sys.exit(job(sys.argv[2:]))
    print(json.dumps(run(), indent=1))
