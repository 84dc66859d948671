import os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(0.3)
    raise ValueError("first failure on rank 1\nsecond line of the message")
time.sleep(2)
try:
    raise KeyError("inner")
except KeyError as e:
    raise RuntimeError("rank 0 fails later") from e
