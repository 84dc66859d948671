"""What people and tools see: the console, the event log, the status text, sd_notify, Prometheus metrics,
and the small formatters they share."""
