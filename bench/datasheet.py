"""The vendor's peak figures for the cards the benchmarks run on, shown beside what ``bench.bounds`` measures.

A datasheet peak is what the card is sold as; the measured bound is what it did here. The dashboard sets the
stages against the measured bound and prints the datasheet figure next to it, so a reader sees both. Keyed by the
name the CUDA driver gives the card (``torch.cuda.get_device_name``, the same as ``nvidia-smi``'s ``name``); a card
not listed has no datasheet figure (``None``), never a guessed one.
"""

from __future__ import annotations

PEAKS: dict[str, dict] = {
    # NVIDIA H200 datasheet (H200 SXM, which the driver names plainly "NVIDIA H200"): BF16 Tensor Core 1,979
    # TFLOP/s with 2:4 sparsity, i.e. 989 dense; GPU memory bandwidth 4.8 TB/s.
    "NVIDIA H200": {"bf16_dense_tflop_per_s": 989.0, "memory_gb_per_s": 4800.0, "source": "NVIDIA H200 datasheet"},
    # NVIDIA H100 datasheet (H100 SXM, "NVIDIA H100 80GB HBM3"): BF16 1,979 TFLOP/s sparse (989 dense), 3.35 TB/s.
    "NVIDIA H100 80GB HBM3": {"bf16_dense_tflop_per_s": 989.0, "memory_gb_per_s": 3350.0,
                              "source": "NVIDIA H100 datasheet"},
}


def peaks(device_name: str | None) -> dict | None:
    """The datasheet peaks of the card called ``device_name`` (``bf16_dense_tflop_per_s``, ``memory_gb_per_s``,
    ``source``), or None for a card not in the table."""
    found = PEAKS.get((device_name or "").strip())
    return dict(found) if found else None
