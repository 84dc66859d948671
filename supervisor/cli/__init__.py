"""The `fsdp-supervisor` command line: argparse and the commands, nothing else. Nothing imports this package.

The console script is `fsdp_supervisor_entry:main`, which calls `supervisor.cli.app.main`.
"""
