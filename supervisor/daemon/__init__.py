"""The running supervisor: the composition root (`run`), the reactor (`core`), the event loop, the housekeeping
pass and the OS seam's real implementation. The only layer with side effects that span the others."""
