"""The reference training loop: resume, train, evaluate, checkpoint, stop gracefully. Entry: `python -m trainer`.

Evaluation (`--eval-every N`) runs on held-out data (trainer/data.py) under `torch.no_grad()`, draws from no
RNG and changes no checkpointed state, so a run resumes bit-exactly with it on, and trains exactly as with it
off. An evaluated step is always saved, with `val_loss` in its manifest: retention's `keep_best` sees every
evaluation, and `--export-best`'s `best.json` always names an existing checkpoint (a new best's save is
blocking, and the export follows its commit).
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import record

from supervisor.errors import CheckpointIOError, UsageError
from supervisor.layout import step_dir_name
from trainer.best import Best, improves, missed_export, read_best, remove_leftovers, write_best
from trainer.checkpoint import Checkpointer, broadcast_from_rank0, load_checkpoint, resolve_resume
from trainer.data import Data, datasets, rank_batch
from trainer.heartbeat import Heartbeat
from trainer.log import configure, get_logger
from trainer.model import ModelConfig, TinyLM, lm_loss
from trainer.parallel import Dist, init_distributed, shard_model, shutdown
from trainer.progress import Progress as ProgressReport
from trainer.schedule import lr_factor
from trainer.state import ModelState, OptimizerState, Progress, RngState, full_model_weights, seed_rank_rngs
from trainer.steptime import StepTimer
from trainer.stopping import GracefulStop

__all__ = ["Trainer", "run", "CheckpointIOError"]


class Trainer:
    """One training job on one rank; everything that must survive a restart is in `state()`."""

    # configuration
    args: argparse.Namespace
    dist: Dist
    # model and optimization
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    # data and position
    data: Data
    val_data: Data | None  # held out; None when --eval-every is 0
    progress: Progress
    # evaluation and the best model (not checkpointed: best.json and the manifests are the record)
    val_loss: float | None  # the latest evaluation (heartbeat); only its own step's save records it
    best: Best | None  # rank 0: the best exported so far (--export-best)
    # side channels
    heartbeat: Heartbeat
    step_timer: StepTimer  # this rank's own time per step, for its heartbeat (stragglers)
    stopper: GracefulStop
    saver: Checkpointer
    last_saved_step: int  # the newest step the durable root holds from this run (the local tier's do not count)

    def __init__(self, args: argparse.Namespace, d: Dist, stopper: GracefulStop, heartbeat: Heartbeat) -> None:
        self.args, self.dist, self.stopper, self.heartbeat = args, d, stopper, heartbeat
        self.log = get_logger()
        self.progress = Progress(world_size=d.world_size, seed=args.seed)
        self.last_saved_step = 0  # step 0 is reproducible from the seed: never worth an emergency save
        self.data, self.val_data = datasets(args.seed, args.seq_len, args.data, held_out=bool(args.eval_every))
        self.val_loss, self.best = None, None
        self.step_timer = StepTimer(d.device)
        self.skipped = 0  # data steps skipped over the run, up to this attempt's skip (manifest: skipped_steps)

    def build(self) -> None:
        """Model (identical init on every rank), FSDP, AdamW and the lr schedule; then per-rank RNG."""
        a = self.args
        torch.manual_seed(a.seed)
        cfg = ModelConfig(d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, seq_len=a.seq_len)
        self.model = shard_model(TinyLM(cfg).to(self.dist.device), a.fsdp, self.dist.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=0.01)
        schedule = functools.partial(lr_factor, warmup_steps=a.warmup_steps, total_steps=a.steps,
                                     min_ratio=a.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        seed_rank_rngs(a.seed, self.dist.rank)

    def state(self, *, rng: bool = True) -> dict[str, Any]:
        """The DCP state dict: model, optim, lr_scheduler, train (progress) and this rank's RNG."""
        state: dict[str, Any] = {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.scheduler,
            "train": self.progress,
        }
        if rng:
            state["rng"] = RngState(self.dist.rank)
        return state

    def read_progress(self, path: Path) -> int:
        """Load only the counters of `path` (cheap); returns the world size that saved it."""
        load_checkpoint(path, {"train": self.progress}, process_group=self.dist.ckpt)
        saved_world = self.progress.world_size
        self.progress.world_size = self.dist.world_size
        # A step resumed from the node-local tier is not in the durable root yet: a stop there still saves it.
        self.last_saved_step = -1 if _in_root(path, self.args.local_checkpoint_dir) else self.progress.step
        return saved_world

    def load(self, path: Path, saved_world: int) -> None:
        """Load everything else; RNG only at the same world size (other sizes lose only bit-exactness)."""
        same_world = saved_world == self.dist.world_size
        if not same_world and self.dist.rank == 0:
            self.log.warning("rng_not_restored", reason="world size changed",
                             saved_world_size=saved_world, world_size=self.dist.world_size)
        state = self.state(rng=same_world)
        del state["train"]
        load_checkpoint(path, state, process_group=self.dist.ckpt)

    def skip(self, steps: int, resumed: Path | None) -> None:
        """Advance the data position by `steps` global batches without training on them (a divergence's rollback);
        the manifests of later saves say how many steps this run skipped in all (those of `resumed`, and these).
        Collective: rank 0's count wins (each node's supervisor judges the onset from its own beats)."""
        steps = broadcast_from_rank0(steps, self.dist.control)
        before = _manifest_metric(resumed, "skipped_steps") if resumed is not None else None
        self.skipped = int(before or 0) + steps
        if steps == 0:
            return
        self.progress.sample_index += steps * self.dist.world_size * self.args.batch_size
        if self.dist.rank == 0:
            self.log.warning("data_skipped", steps=steps, step=self.progress.step,
                             sample_index=self.progress.sample_index)

    def train_step(self) -> float:
        """One optimizer step on this rank's slice of the global batch; returns the mean loss of all ranks."""
        a, p = self.args, self.progress
        self.step_timer.start()
        batch = torch.from_numpy(rank_batch(self.data, p.sample_index, self.dist.rank, a.batch_size))
        loss = lm_loss(self.model, batch.to(self.dist.device))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        p.step += 1
        p.sample_index += self.dist.world_size * a.batch_size
        mean = loss.detach().clone()
        self.step_timer.arrived()  # what follows waits for the slowest rank
        dist.all_reduce(mean)
        p.loss = mean.item() / self.dist.world_size
        return p.loss

    def evaluate(self) -> float:
        """Collective: mean held-out loss over every rank's `--eval-batches` batches (the same samples each time)."""
        a, p, d = self.args, self.progress, self.dist
        assert self.val_data is not None
        self.heartbeat.beat(p.step, "eval", p.loss)
        total = torch.zeros((), device=d.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for k in range(a.eval_batches):
                    rows = rank_batch(self.val_data, k * d.world_size * a.batch_size, d.rank, a.batch_size)
                    total += lm_loss(self.model, torch.from_numpy(rows).to(d.device))
                    # A long evaluation is progress, not a hang: keep the beat fresh (written at most every second).
                    self.heartbeat.beat(p.step, "eval", p.loss)
        finally:
            self.model.train()
        dist.all_reduce(total)
        # Rank 0's value on every rank: whether it is a new best decides collectives (a blocking save, a gather).
        self.val_loss = broadcast_from_rank0(total.item() / (d.world_size * a.eval_batches), self.dist.control)
        self.heartbeat.beat(p.step, "eval", p.loss, val_loss=self.val_loss)
        if d.rank == 0:
            self.log.info("evaluated", step=p.step, val_loss=self.val_loss)
        return self.val_loss

    def is_new_best(self, val_loss: float) -> bool:
        """Collective when exporting: rank 0 compares with the best so far and tells every rank."""
        if self.args.export_best is None:
            return False
        return bool(broadcast_from_rank0(self.dist.rank == 0 and improves(self.best, val_loss), self.dist.control))

    def export_best(self, val_loss: float, checkpoint: Path) -> None:
        """Collective: gather the full model; rank 0 writes it and best.json naming `checkpoint` (committed)."""
        step = self.progress.step
        weights = full_model_weights(self.model)
        if self.dist.rank != 0:
            return
        best = Best(step, val_loss, os.path.abspath(checkpoint))
        try:
            self.best = write_best(self.args.export_best, weights, best)
        except (OSError, UsageError) as exc:  # a full disk, another model's files in DIR: training goes on
            self.log.error("best_model_failed", step=step, error=str(exc))
            return
        if self.best == best:
            self.log.info("best_model_saved", step=step, val_loss=val_loss, path=str(self.args.export_best))
        else:
            self.log.info("best_model_kept", step=step, val_loss=val_loss, best_step=self.best.step,
                          best_val_loss=self.best.val_loss, reason="another run wrote a lower val_loss there")

    def recall_best(self, resumed: Path | None) -> bool:
        """Collective: the latest val_loss and (rank 0) the best so far from disk, before training goes on.

        Returns whether the resumed checkpoint is a new best whose export the last run did not finish (it may
        be the final step: a run that is already done still owes it); `recover_best` then exports it.
        """
        a = self.args
        if not a.eval_every:
            return False
        decided: tuple[float | None, bool] = (None, False)
        if self.dist.rank == 0:
            if a.export_best is not None:
                remove_leftovers(a.export_best)
                self.best, problem = read_best(a.export_best)
                if problem is not None:
                    self.log.warning("best_model_ignored", reason=problem)
            val = _manifest_val_loss(resumed) if resumed is not None else None
            redo = a.export_best is not None and missed_export(self.best, self.progress.step, val, a.eval_every)
            decided = (val, redo)
        val, redo = broadcast_from_rank0(decided, self.dist.control)
        self.val_loss = self.heartbeat.val_loss = val
        return redo

    def recover_best(self, resumed: Path) -> None:
        """Collective: export the loaded weights, those of `resumed`, the new best the last run did not finish."""
        if self.dist.rank == 0:
            self.log.warning("best_model_recovered", step=self.progress.step, val_loss=self.val_loss,
                             reason="the last run stopped between this checkpoint and its export")
        self.export_best(self.val_loss, resumed)  # type: ignore[arg-type]

    def save(self, *, blocking: bool, val_loss: float | None = None, local: bool = False) -> None:
        """Checkpoint the current step (collective); async unless `blocking` or --async-save is off; `local`: into
        the node-local tier (same commit and manifest) instead of the durable root."""
        step, loss = self.progress.step, self.progress.loss
        self.heartbeat.beat(step, "save", loss)
        self._report(self.saver.wait())
        metrics = {"loss": loss} if val_loss is None else {"loss": loss, "val_loss": val_loss}
        if self.skipped:
            metrics["skipped_steps"] = self.skipped
        result = self.saver.save(step, self.state(), metrics=metrics, blocking=blocking or not self.args.async_save,
                                 root=self.args.local_checkpoint_dir if local else None)
        if not local:
            self.last_saved_step = step
        if result.future is None:
            self._report(result)

    def _report(self, result: Any) -> None:
        if result is not None and result.error is not None:  # the local tier: training goes on with durable saves
            self.heartbeat.local_tier = f"local save of step {result.step} failed ({result.errno or 'see the job log'})"
            if self.dist.rank == 0:
                self.log.warning("local_save_failed", step=result.step, errno=result.errno, path=str(result.tmp.parent),
                                 error=str(result.error).splitlines()[0][:300])
        elif result is not None:
            if _in_root(result.final, self.args.local_checkpoint_dir):
                self.heartbeat.local_tier = None  # the tier works again
            if self.dist.rank == 0:
                self.log.info("checkpoint_saved", step=result.step, path=str(result.final),
                              seconds=round(result.seconds, 3), created=result.created)

    def train(self) -> int:
        """The loop; every decision that needs all ranks happens at a step boundary."""
        a, p = self.args, self.progress
        report = ProgressReport(rank=self.dist.rank, start=p.step, total=a.steps, log_every=a.log_every,
                                tokens_per_step=self.dist.world_size * a.batch_size * a.seq_len, log=self.log)
        self.heartbeat.beat(p.step, "train", p.loss)
        try:
            while True:
                self._report(self.saver.poll())
                if self.stopper.should_stop():
                    return self._stop()
                if p.step >= a.steps:
                    break
                loss = self.train_step()
                self.heartbeat.beat(p.step, "train", loss, step_s=self.step_timer.seconds())
                report.update(p.step, loss)
                val = self.evaluate() if a.eval_every and p.step % a.eval_every == 0 else None
                new_best = val is not None and self.is_new_best(val)
                if val is not None or (p.step % a.save_every == 0 and p.step < a.steps):
                    self.save(blocking=new_best, val_loss=val)
                elif a.local_save_every and p.step % a.local_save_every == 0 and p.step < a.steps:
                    self.save(blocking=False, local=True)  # a durable step is never saved only here
                if new_best:
                    self.export_best(val, a.checkpoint_dir / step_dir_name(p.step))  # type: ignore[arg-type]
        finally:
            report.close()
        if self.last_saved_step != p.step:
            self.save(blocking=True)
        self._report(self.saver.wait())
        if self.dist.rank == 0:
            self.log.info("finished", step=p.step, loss=p.loss)
        return 0

    def already_done(self) -> int:
        if self.dist.rank == 0:
            self.log.info("already_done", step=self.progress.step, steps=self.args.steps)
        return 0

    def _stop(self) -> int:
        """Every rank agreed to stop: finish any save in flight, save this step, exit 0."""
        step = self.progress.step
        if self.dist.rank == 0:
            signum = self.stopper.signum
            self.log.warning("stop_requested", step=step, signal=signum)
        self._report(self.saver.wait())
        if self.last_saved_step != step:
            # No val_loss: the latest evaluation measured older weights, and keep_best would count it twice.
            self.save(blocking=True)
        if self.dist.rank == 0:
            self.log.info("stopped", step=step)
        return 0


def _in_root(path: Path, root: Path | None) -> bool:
    """Is checkpoint `path` a child of `root` (symlinks resolved)?"""
    return root is not None and os.path.realpath(path.parent) == os.path.realpath(root)


def _manifest_val_loss(path: Path) -> float | None:
    return _manifest_metric(path, "val_loss")


def _manifest_metric(path: Path, name: str) -> float | None:
    """The metric `name` a checkpoint's manifest recorded, or None (no manifest, no value, unreadable)."""
    from supervisor.checkpoints.manifest import read_manifest
    from supervisor.errors import ManifestError

    try:
        manifest = read_manifest(path)
    except (ManifestError, OSError):
        return None
    return manifest.metrics.get(name) if manifest is not None else None


def _quiet_known_warnings() -> None:
    # FSDP1's ShardedTensor path and DCP's single-process mode warn on every save; they are expected here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", message=r".*_get_pg_default_device.*")
    warnings.filterwarnings("ignore", message=r"Multiple backends are registered.*")
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled.*")


@record
def run(args: argparse.Namespace) -> int:
    """Run the job described by validated `args`; returns the process exit code."""
    configure(int(os.environ.get("RANK", "0")))
    _quiet_known_warnings()
    stopper = GracefulStop(repeat_grace_s=1.0).install()  # before init: a stop during startup counts too
    d = init_distributed(args.pg_timeout_s)
    stopper.group = d.control
    # Local rank 0 of every node writes the node's heartbeat (the step and the all-reduced loss are the same on
    # every rank), so each node's supervisor gets hang detection; every rank writes its own file besides.
    heartbeat = Heartbeat.from_env(int(os.environ.get("LOCAL_RANK", d.rank)))
    Heartbeat.checks_loads = True  # every load below is load_checkpoint's: the supervisor need not read it first
    heartbeat.beat(0, "load")
    trainer = Trainer(args, d, stopper, heartbeat)
    log = trainer.log
    problem = broadcast_from_rank0(getattr(args, "local_tier_problem", None), d.control)  # rank 0's look: all alike
    if problem is not None and args.local_save_every:
        args.local_save_every = 0
        heartbeat.local_tier = f"unusable: {problem}"
        if d.rank == 0:
            log.warning("local_tier_unusable", reason=problem, action="durable saves only")
    if d.rank == 0:
        log.info("started", world_size=d.world_size, device=str(d.device), fsdp=args.fsdp,
                 checkpoint_dir=str(args.checkpoint_dir))
    try:
        path = resolve_resume(args.resume, args.checkpoint_dir, group=d.control, local=args.local_checkpoint_dir)
        saved_world = trainer.read_progress(path) if path is not None else d.world_size
        if path is not None and d.rank == 0:
            log.info("resuming", path=str(path), step=trainer.progress.step, saved_world_size=saved_world)
        heartbeat.beat(trainer.progress.step, "load", trainer.progress.loss, force=True)
        recover = trainer.recall_best(path)
        done = trainer.progress.step >= args.steps
        local_only = trainer.last_saved_step < 0  # resumed from the node-local tier: not in the durable root yet
        if done and not recover and not local_only:
            return trainer.already_done()
        trainer.build()
        if path is not None:
            started = time.monotonic()
            trainer.load(path, saved_world)
            if d.rank == 0:
                log.info("loaded", path=str(path), step=trainer.progress.step,
                         seconds=round(time.monotonic() - started, 3))
        trainer.skip(args.skip_steps if not done else 0, path)
        if recover:
            trainer.recover_best(path)  # type: ignore[arg-type]
        trainer.saver = Checkpointer(args.checkpoint_dir, process_group=d.ckpt, control_group=d.control,
                                     async_save=args.async_save, sha256=args.manifest_sha256)
        if done:
            if local_only:  # a finished run's last step is never only in the local tier
                trainer.save(blocking=True)
            return trainer.already_done()
        # torch, the model and the optimizer are ~300k objects that live for the whole run: keep them out of
        # the cyclic GC's full collections, which otherwise stall a random step or save for ~0.3 s.
        gc.freeze()
        return trainer.train()
    except CheckpointException as exc:
        # DCP raises a BaseException, which @record lets pass without writing torchrun's error file: the
        # supervisor would then report a failed save or load (e.g. a full disk) as a bare "exitcode 1".
        raise CheckpointIOError(str(exc)) from exc
    finally:
        shutdown()
