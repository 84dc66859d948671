"""The run's history, read side: the `history.jsonl` schema and reader (`records`), the fold into goodput and
losses (`fold`), the HTML report (`html`, `svg`). The daemon's writer is `supervisor.daemon.recorder`."""
