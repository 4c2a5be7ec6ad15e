"""The DiT's transformer call replayed from CUDA graphs, one graph per call signature.

Why: a denoise step is ~570 kernel launches. At 512x512 the Python and launch work of one CFG step takes longer
than the GPU needs to run its kernels (measured on the H200: ~40 ms a step eagerly against ~20 ms of kernel
time, ``bench/results/h200/dit_graphs.json``), so the GPU waits on the CPU. A replayed graph launches them all
at once.

A signature is what the transformer's Python control flow depends on: the latent batch shape, the padded
condition shape, each row's condition length, dtypes and device. A graph captured for a signature computes any
later call with that signature; the values (latents, timesteps, conditions) are copied into its input buffers.
The first call of a signature runs eagerly (it also lets torch.compile, cuDNN and cuBLAS do their first-call
work outside a capture), the second is captured, later ones replay. Graphs share one memory pool; at most
``max_graphs`` are kept, the least recently used dropped first. If a capture fails, graphs are turned off for
the process (logged once) and every call runs eagerly.

A call with reference latents (an edit's cond and ref branches) runs eagerly: its shapes depend on each reference's
size, one more key a graph would be captured for, rarely seen twice. Counted as ``eager_edit``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SEEN_SIGNATURES = 256  # signatures remembered as seen once (so the next call captures); oldest forgotten first


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # latents, timestep, condition (static buffers)
    output: torch.Tensor


class GraphedTransformer:
    """Callable as the transformer (latents, timestep, condition, condition_lengths) -> velocity."""

    def __init__(self, transformer: Callable[..., torch.Tensor], max_graphs: int = 8):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1; got {max_graphs}")
        self.transformer = transformer
        self.max_graphs = max_graphs
        self.disabled_reason: str | None = None
        self.counts = {"eager": 0, "eager_edit": 0, "captured": 0, "replayed": 0, "evicted": 0}
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the type torch.cuda.graph_pool_handle() returns

    def __call__(
        self, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor,
        condition_lengths: Sequence[int] | None = None,
        references: Sequence[Sequence[torch.Tensor] | None] | None = None,
    ) -> torch.Tensor:
        lengths = None if condition_lengths is None else tuple(int(n) for n in condition_lengths)
        if references is not None and any(references):  # an edit: eager (module docstring)
            self.counts["eager_edit"] += 1
            return self.transformer(latents, timestep, condition, lengths, references=references)
        if self.disabled_reason is not None or not latents.is_cuda:
            return self._eager(latents, timestep, condition, lengths)
        key = (latents.device, *((tuple(t.shape), t.dtype) for t in (latents, timestep, condition)), lengths)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > SEEN_SIGNATURES:
                    self._seen.popitem(last=False)
                return self._eager(latents, timestep, condition, lengths)
            entry = self._capture(key, latents, timestep, condition, lengths)
            if entry is None:
                return self._eager(latents, timestep, condition, lengths)
        else:
            self._graphs.move_to_end(key)
            self.counts["replayed"] += 1
        for buffer, value in zip(entry.inputs, (latents, timestep, condition), strict=True):
            buffer.copy_(value)
        entry.graph.replay()
        return entry.output.clone()  # the buffer is overwritten by the next replay

    def _eager(self, latents, timestep, condition, lengths) -> torch.Tensor:
        self.counts["eager"] += 1
        return self.transformer(latents, timestep, condition, lengths)

    def _capture(self, key, latents, timestep, condition, lengths) -> _Graph | None:
        inputs = (latents.clone(), timestep.clone(), condition.clone())
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            # thread_local: CUDA work on other threads (none is expected) neither breaks nor joins the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self.transformer(*inputs, lengths)
        except Exception as exc:
            self.disabled_reason = f"capture failed: {exc!r}"
            log.exception("CUDA graph capture of the DiT step failed; running every step eagerly from now on")
            self._graphs.clear()
            torch.cuda.synchronize()
            return None
        self.counts["captured"] += 1
        self._graphs[key] = entry = _Graph(graph, inputs, output)
        self._seen.pop(key, None)
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.counts["evicted"] += 1
        return entry
