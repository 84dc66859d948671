"""DCP save/load with atomic commit, async saves, and the choice of the checkpoint to resume from.

Use it from your own FSDP loop (every call is collective: call it on every rank)::

    from trainer.checkpoint import Checkpointer, load_checkpoint, resolve_resume
    from trainer.state import ModelState, OptimizerState

    state = {"model": ModelState(model), "optim": OptimizerState(model, optim), "epoch": progress}
    path = resolve_resume("auto", "ckpts")          # newest complete, decided by rank 0, broadcast
    if path is not None:
        load_checkpoint(path, state)
    saver = Checkpointer("ckpts", async_save=True,            # async: DCP runs in a writer thread, so
                         process_group=dist.new_group(backend="gloo"))  # give it its own gloo group
    for step in ...:
        ...
        saver.poll()                                  # commits a finished background save
        if step % 100 == 0:
            saver.save(step, state, metrics={"loss": loss})
    saver.wait()                                      # before exit: finish and commit the last save

A save writes `<root>/.tmp-step_<N>-<nonce>/` and becomes `<root>/step_<N>/` only after DCP's `.metadata`
exists, the manifest is written and everything is fsynced (see trainer/commit.py and docs/trainer.md).
"""
from __future__ import annotations

import errno as errno_names
import os
import re
import secrets
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import WriteResult

from supervisor.checkpoints.integrity import Segment
from supervisor.checkpoints.lineage import root_lineage
from supervisor.errors import CheckpointCorruptError
from supervisor.host.gcpause import collector_paused
from supervisor.layout import step_dir_name, tmp_dir_name
from trainer.checksums import HashingFileSystem, checked_results, collect
from trainer.commit import build_manifest, commit
from trainer.heartbeat import Heartbeat
from trainer.reader import CheckpointReader
from trainer.staging import CachedStager

__all__ = ["Checkpointer", "save_checkpoint", "load_checkpoint", "resolve_resume", "SaveResult",
           "broadcast_from_rank0"]

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


_T = TypeVar("_T")


def broadcast_from_rank0(value: _T, group: dist.ProcessGroup | None) -> _T:
    """Collective: rank 0's `value` (any picklable object), on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class _Writer(FileSystemWriter):
    """DCP's file writer that checksums every item as it writes it (trainer/checksums.py), minus the zip CRC32
    that `torch.save` computes for every tensor record.

    Nothing checks that CRC32 (neither `torch.load` nor DCP's reader), and it cost ~20% of a save's write time
    on 2 CPU cores; our xxh3_64 ranges are checked by every load. The switch is process-wide, so it is off only
    while this writer writes. The other writer settings (one thread, one file per rank, fsync per file) are
    DCP's defaults on purpose: measured alternatives were no faster (docs/performance-scale.md).
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs: HashingFileSystem = HashingFileSystem()
        self.checksums: dict[str, list[Segment]] | None = None  # on the coordinator, once `.metadata` is written

    def write_data(self, plan: Any, planner: Any) -> Any:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            results = super().write_data(plan, planner).wait()
        finally:
            torch.serialization.set_crc32_options(previous)
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(checked_results(results, self.fs, Path(self.path)))
        return done

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.checksums = collect(results, self.fs, Path(self.path))


class SaveResult:
    """One save: where it is written, and (on rank 0, once committed) where it ended up."""

    def __init__(self, step: int, tmp: Path, final: Path, metrics: dict[str, Any], started: float) -> None:
        self.step, self.tmp, self.final, self.metrics, self.started = step, tmp, final, metrics, started
        self.future: Future[None] | None = None
        self.created: bool | None = None  # rank 0 after commit: False if an existing `final` won
        self.seconds: float | None = None
        self.writer: _Writer | None = None
        self.optional = False  # a save into the node-local tier: its failure is said, not raised
        self.error: BaseException | None = None  # why an optional save failed (nothing committed)

    @property
    def errno(self) -> str | None:
        """The failure's errno name (`ENOSPC`, `EROFS`), from any rank's error DCP gathered, or None."""
        errors = [self.error, *(e for e, _ in getattr(self.error, "failures", {}).values())]
        while errors:
            exc = errors.pop(0)
            if isinstance(exc, OSError) and exc.errno is not None:
                return errno_names.errorcode.get(exc.errno, str(exc.errno))
            errors += [e for e in (getattr(exc, "__cause__", None), getattr(exc, "__context__", None)) if e]
        return None


def _lineage(root: Path) -> str | None:
    if _rank() != 0:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root_lineage(root, create=True)
    except OSError:  # no lineage: local saves are then no run's, and never resumed
        return None


class Checkpointer:
    """Saves `step_<N>` checkpoints under `root`, sync or async; at most one save in flight."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        process_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        async_save: bool = False,
        sha256: bool = False,
    ) -> None:
        self.root = Path(root)
        self.group = process_group  # DCP coordination; async saves use it from a writer thread
        self.control = control_group
        self.async_save = async_save
        self.sha256 = sha256
        self.pending: SaveResult | None = None
        self.last: SaveResult | None = None
        self._stager: CachedStager | None = None  # CPU buffers reused by every async save (one in flight)
        # One nonce per run (rank 0 draws, all ranks agree): temp names never collide with a dead attempt's. And
        # the run's lineage, written into every manifest: a local-tier save is resumed only by its run (lineage.py).
        self.nonce, self.lineage = broadcast_from_rank0((secrets.token_hex(4), _lineage(self.root)), control_group)

    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, Any] | None = None,
             blocking: bool | None = None, root: str | os.PathLike[str] | None = None) -> SaveResult:
        """Collective: write `state` as step `step`; blocks until committed unless saving asynchronously.

        `root` saves into another root than the Checkpointer's (the node-local tier), with the same atomic commit
        and manifest, the same staging buffers, and still never two saves in flight. A save there is optional: its
        failure (a full or read-only tier) does not raise but is in the returned (or, async, the next `poll`/`wait`)
        result's `error` and `errno`, and what it left is removed.
        """
        self.wait()  # never two saves in flight
        into = self.root if root is None else Path(root)
        tmp = into / tmp_dir_name(step, self.nonce)
        result = SaveResult(step, tmp, into / step_dir_name(step), dict(metrics or {}), time.monotonic())
        result.optional = root is not None
        writer = result.writer = _Writer(tmp)
        if (self.async_save if blocking is None else not blocking):
            if self._stager is None:
                self._stager = CachedStager()
            # Our stager: DCP's default one for a FileSystemWriter stalls ~8x a memcpy (see trainer/staging.py).
            response = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                      async_stager=self._stager)
            # A Future with the default stager; newer stagers return an AsyncSaveResponse instead.
            # Either way a Future[None] here; torch types the call's result as the union.
            result.future = cast("Future[None]", getattr(response, "upload_completion", response))
            self.pending = result
            return result
        self._finish(result, lambda: dcp.save(state, storage_writer=writer, process_group=self.group))
        return result

    def poll(self) -> SaveResult | None:
        """Commit the in-flight async save if its write finished everywhere; returns it then."""
        if self.pending is None or self.pending.future is None or not self.pending.future.done():
            return None
        return self.wait()

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save (if any) is written, then commit it; re-raises its error."""
        result, self.pending = self.pending, None
        if result is None:
            return None
        assert result.future is not None
        self._finish(result, result.future.result)
        return result

    def _finish(self, result: SaveResult, write: Any) -> None:
        """Write (or wait for the write), then commit; an optional save's failure is kept in `result.error` (every
        rank gets DCP's gathered error, so all go on alike) and rank 0 removes what it left."""
        try:
            write()
            self._commit(result)
        except (Exception, CheckpointException) as exc:
            if not result.optional:
                raise
            result.error = exc
            if _rank() == 0:
                shutil.rmtree(result.tmp, ignore_errors=True)

    def _commit(self, result: SaveResult) -> None:
        # Rank 0's DCP call returns only after its coordinator step wrote `.metadata`, which needs every
        # rank's write results first: no extra barrier is needed before the rename.
        if _rank() == 0:
            manifest = build_manifest(
                result.tmp,
                step=result.step,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                torch_version=torch.__version__,
                metrics=result.metrics,
                sha256=self.sha256,
                checksums=result.writer.checksums if result.writer is not None else None,
                lineage=self.lineage,
            )
            result.final, result.created = commit(result.tmp, result.final, manifest)
        result.seconds = time.monotonic() - result.started
        self.last = result


def save_checkpoint(root: str | os.PathLike[str], step: int, state: dict[str, Any], *,
                    metrics: dict[str, Any] | None = None,
                    process_group: dist.ProcessGroup | None = None) -> Path:
    """Collective, synchronous: save and commit `<root>/step_<N>`; returns its path."""
    saver = Checkpointer(root, process_group=process_group, control_group=process_group)
    return saver.save(step, state, metrics=metrics, blocking=True).final


_CORRUPT = re.compile(r"checkpoint corrupt: [^;\n]*")


def load_checkpoint(path: str | os.PathLike[str], state: dict[str, Any], *,
                    process_group: dist.ProcessGroup | None = None) -> None:
    """Collective: load `path` into `state` in place (Stateful entries get `load_state_dict`); DCP reshards.

    The cyclic garbage collector is paused during the load: a full collection of a process that imported
    torch held the GIL for 0.2-0.35 s in about one cold 1.2 GB load in three (docs/performance-scale.md).
    """
    # Our reader: records that are exactly their destination are read in place (trainer/reader.py).
    with collector_paused():
        try:
            dcp.load(state, checkpoint_id=os.fspath(path), storage_reader=CheckpointReader(path),
                     process_group=process_group)
        except CheckpointException as exc:  # a rank found bytes that fail their checksum: say which, on every rank
            # DCP folds a failed `.metadata` read into an AssertionError's message: find ours by its words.
            found = [m.group(0) for f in exc.failures.values() if (m := _CORRUPT.search(str(f[0])))]
            if found:
                raise CheckpointCorruptError(found[0]) from exc
            raise
    Heartbeat.checks_loads = True  # this job's loads check: said in its heartbeat (trainer/heartbeat.py)


def resolve_resume(spec: str, root: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None,
                   local: str | os.PathLike[str] | None = None) -> Path | None:
    """Collective: the checkpoint to resume from: `"none"`, `"auto"` (newest complete under `root`, or under the
    node-local tier `local` when that one is newer and of this run's lineage) or a path.

    For `"auto"` only rank 0 looks at the disk and broadcasts its choice, so all ranks load the same one
    even if a save lands meanwhile. Completeness and the order across tiers are `supervisor.checkpoints`'
    verdict, the same one the supervisor uses.
    """
    if spec == "none":
        return None
    if spec != "auto":
        return Path(spec)
    choice = None
    if _rank() == 0:
        from supervisor.checkpoints import newest_across

        info = newest_across(root, local)
        choice = os.fspath(info.path) if info is not None else None
    choice = broadcast_from_rank0(choice, group)
    return Path(choice) if choice is not None else None
