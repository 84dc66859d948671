"""The `fsdp-supervisor` command line: argparse and the commands, nothing else. Nothing imports this package."""
