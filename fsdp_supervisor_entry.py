"""The `fsdp-supervisor` console script: make sure `supervisor` and `trainer` are ours before importing them.

Both import names are taken on the package index too (supervisord's `supervisor`, Coqui's `trainer`). Installed
into one environment after us, the other distribution overwrites files of ours and pip says nothing; a copy
first on `sys.path` (PYTHONPATH, the current directory) shadows ours. Either way `from supervisor.cli import
main` would fail with a traceback, or run someone else's code. So the console script lives in this one module,
whose name no one else uses, and imports nothing of ours until the check passes: exit 2 with one line naming
the other distribution and the fix (a venv of its own).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["DIST", "NAMES", "clash", "check", "main"]

DIST = "fsdp-supervisor"
NAMES = ("supervisor", "trainer")
EXIT_USAGE = 2  # supervisor.errors.EXIT_USAGE, not imported from there: `supervisor` may not be ours
FIX = "install fsdp-supervisor into a venv of its own (README, Install)"


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def clash(name: str, owners: Iterable[str], package_dir: Path | None, ours: Path | None) -> str | None:
    """Why the import name `name` is not ours here, or None (pure).

    `owners`: the distributions that installed files under `name` in this environment; `package_dir`: where
    `import name` resolves (None: nowhere, or a namespace without `__init__.py`); `ours`: our copy next to
    this module, if there is one.
    """
    others = sorted({o for o in owners if _canonical(o) != DIST})
    if others:
        where = f" ({package_dir})" if package_dir is not None else ""
        return (f"the import name {name!r}{where} also belongs to the distribution {', '.join(others)}, "
                f"which overwrites or shadows ours; {FIX}")
    if package_dir is None:
        return f"the package {name!r} is missing or incomplete here (another distribution's uninstall?); {FIX}"
    if ours is not None and package_dir != ours:
        return f"the package {name!r} resolves to {package_dir}, which shadows ours ({ours}); {FIX}"
    return None


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        return None
    return Path(spec.origin).parent.resolve()


def check(owners: Mapping[str, list[str]] | None = None, home: Path | None = None) -> str | None:
    """The first clash of our import names in this interpreter, or None."""
    owners = importlib.metadata.packages_distributions() if owners is None else owners
    home = Path(__file__).resolve().parent if home is None else home
    for name in NAMES:
        ours = home / name
        problem = clash(name, owners.get(name, []), _package_dir(name),
                        ours.resolve() if (ours / "__init__.py").is_file() else None)
        if problem:
            return problem
    return None


def main() -> int:
    problem = check()
    if problem:
        print(f"fsdp-supervisor: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from supervisor.cli.app import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
