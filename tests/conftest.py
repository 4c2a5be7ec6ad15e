"""Suite-wide setup: Triton kernels run in Triton's interpreter, on the CPU tensors of the tiny model; each xdist
worker takes its share of the CPU's cores.

Set before any test module imports ``ar_service.model.decode_kernels`` (Triton reads it when a kernel is
defined). The suite runs its models on the CPU, on machines with a GPU too; the kernels' speed on a GPU is
the benchmarks' business (bench/decode_profile.py).

Threads: torch and OpenMP start as many threads as there are cores in every process. With two workers on two cores
each worker's matmuls then fight the other's (and the services the end-to-end tests start) for the same cores: the
decoder and DiT tests took 330 s that way against 238 s at one thread a worker. ``OMP_NUM_THREADS`` set by hand wins.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

_workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _workers:  # in an xdist worker; the services a test starts inherit the setting too
    # the cores this process may run on (a container or taskset may allow fewer than the host has)
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(_workers))))

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
