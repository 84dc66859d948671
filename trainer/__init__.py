"""Reference FSDP trainer for fsdp-supervisor, and the small library that makes any FSDP loop supervisable.

Run it: `torchrun --standalone --nproc-per-node=2 -m trainer --checkpoint-dir ckpts` (see `--help`).
Checkpoint format: docs/trainer.md, "Checkpoint format".

Make your own loop supervisable with three pieces (all collectives are called on every rank)::

    import torch.distributed as dist
    from datetime import timedelta
    from trainer.checkpoint import Checkpointer, load_checkpoint, resolve_resume
    from trainer.heartbeat import Heartbeat
    from trainer.state import ModelState, OptimizerState
    from trainer.stopping import GracefulStop

    dist.init_process_group("gloo")                      # or "cpu:gloo,cuda:nccl" on GPUs
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    stop = GracefulStop(group=side).install()            # SIGTERM/SIGINT -> flag; SIGUSR1 -> stack dump
    beat = Heartbeat.from_env(rank=int(os.environ["LOCAL_RANK"]))  # the node's file + one per rank (every step)

    state = {"model": ModelState(model), "optim": OptimizerState(model, optim), "extra": my_stateful}
    beat.beat(0, "load")
    path = resolve_resume(args.resume, args.checkpoint_dir, group=side)   # "auto": newest complete
    if path is not None:
        load_checkpoint(path, state)
    # Async saves coordinate from a writer thread: give them a gloo group of their own.
    saver = Checkpointer(args.checkpoint_dir, process_group=dist.new_group(backend="gloo"),
                         control_group=side, async_save=True)
    for step in range(start, total):
        loss = train_one_step()
        beat.beat(step + 1, "train", loss)
        saver.poll()                                     # commit a background save that finished
        if stop.should_stop():                           # every rank gets the same answer
            saver.save(step + 1, state, metrics={"loss": loss}, blocking=True)
            break
        if (step + 1) % 500 == 0:
            beat.beat(step + 1, "save", loss)
            saver.save(step + 1, state, metrics={"loss": loss})
    saver.wait()

Keep the best model by validation loss (`--export-best`'s files) from your loop; `val_loss` must be the same
on every rank (all-reduced), since a new best means collectives::

    from trainer.best import Best, improves, read_best, write_best
    from trainer.state import full_model_weights

    best, problem = read_best("ckpts/best")              # (None, None) in a fresh dir; `problem`: why one is ignored
    if improves(best, val_loss):                         # strictly lower and finite
        saver.save(step, state, metrics={"loss": loss, "val_loss": val_loss}, blocking=True)
        weights = full_model_weights(model)              # every rank; rank 0 gets the full model on CPU
        best = Best(step, val_loss, str(saver.last.final))
        if dist.get_rank() == 0:
            write_best("ckpts/best", weights, best)      # model.safetensors, then best.json

Importing `trainer` itself is cheap; torch is imported by the modules that need it.
"""
from __future__ import annotations

__all__: list[str] = []
