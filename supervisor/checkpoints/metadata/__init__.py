"""DCP's `.metadata`, read without unpickling: `reader` (the entry point), `scan` (a bounded pickle-opcode
interpreter), `records` (its fast path), `allowlist` (which globals may appear), `cache` (parsed summaries on
disk), `child` (large parses in a child process)."""
