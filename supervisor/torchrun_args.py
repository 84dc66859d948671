"""torchrun's command line read without torch: is a command torchrun, its own arguments, a flag's value, its nodes.

Pure, stdlib only: the config refuses the node-local tier for a multi-node job, and the supervisors of one
multi-node job share the root's claim (daemon/preflight.rendezvous_key). torchrun parses with argparse, so a flag
may be abbreviated (`--nnode 2`), the last one given wins, and an absent flag takes its `PET_<NAME>` variable.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["is_torchrun", "launcher_args", "flag", "nnodes", "spans_nodes"]

_MODULE = "torch.distributed.run"
# The shortest unambiguous abbreviation of --nnodes among torchrun's options (--nproc-per-node, --node-rank and
# --no-python share "--n"), as argparse's allow_abbrev accepts it.
_NNODES, _NNODES_SHORTEST = "--nnodes", len("--nn")


def is_torchrun(command: Sequence[str]) -> bool:
    """`torchrun ...`, or `python -m torch.distributed.run ...`."""
    if not command:
        return False
    if os.path.basename(command[0]) == "torchrun":
        return True
    return any(a == "-m" and b == _MODULE for a, b in zip(command, command[1:]))


def launcher_args(command: Sequence[str]) -> Sequence[str]:
    """torchrun's own arguments: after the program (or `-m torch.distributed.run`), before the job's module or script."""
    start = 1
    for i, (a, b) in enumerate(zip(command, command[1:])):
        if a == "-m" and b == _MODULE:
            start = i + 2
            break
    rest = command[start:]
    for i, arg in enumerate(rest):
        if arg in ("-m", "--module") or arg.endswith(".py"):
            return rest[:i]  # the job's own flags follow: a trainer's --nnodes is not torchrun's
    return rest


def flag(args: Sequence[str], name: str, *, shortest: int | None = None) -> str | None:
    """The value of flag `name` in `args` (`--x=v` or `--x v`; `-` and `_` spellings alike; the last one wins, as in
    argparse), else None. `shortest`: abbreviations of `name` down to that many characters count too."""
    found = None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        key = key.replace("_", "-")
        if key == name or (shortest is not None and len(key) >= shortest and name.startswith(key)):
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def nnodes(command: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The `--nnodes` torchrun will use for `command` run with `env` (its flag, else `PET_NNODES`), or None: not
    torchrun, or no node count given (torchrun's default is one node)."""
    if not is_torchrun(command):
        return None
    given = flag(launcher_args(command), _NNODES, shortest=_NNODES_SHORTEST)
    return given if given is not None else env.get("PET_NNODES")


def spans_nodes(value: str | None) -> bool:
    """Whether an `--nnodes` value (`N` or `MIN:MAX`) may put the job on more than one node."""
    if value is None:
        return False
    try:
        return max(int(part) for part in value.split(":")) > 1
    except ValueError:
        return True  # not a count torchrun would accept either: never taken for one node
