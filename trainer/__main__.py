"""`torchrun ... -m trainer --checkpoint-dir DIR [flags]` (or `python -m trainer` for one process)."""
from __future__ import annotations

import sys

from trainer.args import parse_args


def main() -> int:
    # Flags are validated before torch is imported: bad input fails in a fraction of a second.
    args = parse_args()
    from trainer.loop import run

    code = run(args)  # torch's @record types the wrapped function's result as optional
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
