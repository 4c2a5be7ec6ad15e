"""Suite-wide setup: Triton kernels run in Triton's interpreter, on the CPU tensors of the tiny model.

Set before any test module imports ``ar_service.model.decode_kernels`` (Triton reads it when a kernel is
defined). The suite runs its models on the CPU, on machines with a GPU too; the kernels' speed on a GPU is
the benchmarks' business (bench/decode_profile.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
