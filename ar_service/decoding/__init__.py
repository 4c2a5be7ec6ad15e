"""AR decoding: the modes (``modes``: how many tokens a forward decides), the stream of one image (``stream``) and
the decoders a scheduler steps (``decoders``). The package exports the modes; the stream and the decoders are
imported from their modules."""

from ar_service.decoding.modes import (
    DEFAULT_ROW_WINDOW,
    DEFAULT_SPEC_WINDOW,
    MODES,
    ROW_PARALLEL,
    SEQUENTIAL,
    SPECULATIVE,
    Decoding,
    DecodingState,
    Forwarded,
    Lane,
    RowParallel,
    Speculative,
)

__all__ = [
    "DEFAULT_ROW_WINDOW", "DEFAULT_SPEC_WINDOW", "MODES", "ROW_PARALLEL", "SEQUENTIAL", "SPECULATIVE", "Decoding",
    "DecodingState", "Forwarded", "Lane", "RowParallel", "Speculative",
]
