"""Suite-wide setup: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors.

Set before any test module imports ``ar_service.model.decode_kernels`` (Triton reads it when a kernel is
defined), so the decode kernels are checked on the machines that have no GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
