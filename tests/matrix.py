"""The setup matrix: which cells exist, which run in this session. Pure (no torch, no processes).

A cell is one supervised run of the reference trainer in one user setup, with one fault. Its dimensions:

- `root`: how the checkpoint root is set up. `plain`; `symlink` (`ckpts -> <a tmpfs>/ckpts`, the cluster layout:
  another file system); `mount_ro` (the root is a tmpfs mount point whose parent is read-only: nowhere to park a
  deletion, nowhere to put sidecars); `recreated` (a plain root moved aside and restored from a copy mid-run, as
  `mv ckpts ckpts.old && mkdir ckpts && cp -a ckpts.old/step_* ckpts/`).
- `contender`: a second `run` on the same root while the first runs, which must be refused (exit 2):
  `same_config` again, `other_config` (another run dir, the same `dir`), `other_spelling` (another run dir, the
  root named by another path: the symlink's target, or an alias symlink).
- `suspend`: the supervisor is stopped (SIGSTOP) for SUSPEND_S while the job trains on, then continued.
- `backup`: a copy appears in the root mid-run: `backup_dir` (a `backup/` folder of checkpoints), `bak_copy`
  (`step_N.bak` beside its original), or `both`.
- `kill`: the fault that ends an attempt: SIGKILL of a `worker` or the `agent` at a random step, `during_save`,
  or of the `supervisor` in the middle of a retention delete (then a new supervisor).

The full matrix is every root kind with every fault (16 cells); the three other dimensions are laid over them
by an orthogonal array, so every pair of values of any two dimensions meets in at least one cell. A session
runs a seeded sample of it (SAMPLE cells) or, with FSDP_MATRIX=full (`make soak`), all of it.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

__all__ = ["ROOTS", "CONTENDERS", "BACKUPS", "KILLS", "SUSPEND_S", "MATRIX_ENV", "SAMPLE", "Cell", "matrix",
           "session_cells", "all_pairs"]

ROOTS = ("plain", "symlink", "mount_ro", "recreated")
CONTENDERS = ("same_config", "other_config", "other_spelling")
BACKUPS = ("backup_dir", "bak_copy", "both")
KILLS = ("worker", "agent", "during_save", "supervisor")
SUSPEND_S = 15.0
MATRIX_ENV = "FSDP_MATRIX"  # "full": every cell (the soak); unset: a seeded sample
SAMPLE = 1  # cells per `make test` (each costs ~60 s of two loaded cores)


@dataclass(frozen=True)
class Cell:
    root: str
    contender: str
    suspend: bool
    backup: str
    kill: str

    def __str__(self) -> str:  # the pytest id: `-k "symlink and supervisor"` picks cells
        return f"{self.root}-{self.contender}-{'suspend' if self.suspend else 'awake'}-{self.backup}-{self.kill}"

    def values(self) -> tuple[object, ...]:
        return (self.root, self.contender, self.suspend, self.backup, self.kill)


# GF(4) = {0, 1, x, x+1} as 0..3: addition is XOR; multiplication by table.
_MUL = ((0, 0, 0, 0), (0, 1, 2, 3), (0, 2, 3, 1), (0, 3, 1, 2))


def _orthogonal_array() -> list[tuple[int, ...]]:
    """OA(16, 5, 4, 2): rows (a, b, a+b, a+2b, a+3b) over GF(4); any two columns hold each pair of levels once."""
    return [(a, b, *(a ^ _MUL[k][b] for k in (1, 2, 3))) for a in range(4) for b in range(4)]


def matrix() -> list[Cell]:
    """The 16 cells: root x kill in full, contender/suspend/backup from the array's other columns (levels folded)."""
    return [Cell(ROOTS[r], CONTENDERS[c % 3], s % 2 == 1, BACKUPS[b % 3], KILLS[k])
            for r, k, c, s, b in _orthogonal_array()]


def all_pairs() -> set[tuple[int, object, int, object]]:
    """Every (dimension i, value, dimension j, value) pair with i < j: what the matrix must cover."""
    domains: tuple[tuple[object, ...], ...] = (ROOTS, CONTENDERS, (False, True), BACKUPS, KILLS)
    return {(i, u, j, v) for i, di in enumerate(domains) for j, dj in enumerate(domains) if i < j
            for u in di for v in dj}


def session_cells(seed: int) -> list[Cell]:
    """This session's cells: all of them with FSDP_MATRIX=full, else SAMPLE drawn from `seed`."""
    cells = matrix()
    if os.environ.get(MATRIX_ENV) == "full":
        return cells
    return random.Random(seed).sample(cells, SAMPLE)
