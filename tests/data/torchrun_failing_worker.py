import os, sys, time
rank = int(os.environ["RANK"])
def inner():
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
if rank == 1:
    print("rank 1 about to fail", flush=True)
    time.sleep(0.5)
    inner()
time.sleep(30)
