from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FORMAT_UNSPECIFIED: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_PNG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_JPEG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_WEBP: _ClassVar[OutputFormat]
OUTPUT_FORMAT_UNSPECIFIED: OutputFormat
OUTPUT_FORMAT_PNG: OutputFormat
OUTPUT_FORMAT_JPEG: OutputFormat
OUTPUT_FORMAT_WEBP: OutputFormat

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("ar_prefill_ms", "ar_decode_ms", "ar_tokens", "condition_transfer_ms", "dit_queue_ms", "denoise_ms", "vae_decode_ms", "encode_ms", "total_ms", "transformer_calls", "preview_ms", "dit_steps_computed", "dit_steps_skipped", "ar_forwards", "ar_grid_width", "ar_grid_height")
    AR_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    AR_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    AR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DIT_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_MS_FIELD_NUMBER: _ClassVar[int]
    VAE_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMER_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_MS_FIELD_NUMBER: _ClassVar[int]
    DIT_STEPS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    DIT_STEPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    AR_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    AR_GRID_WIDTH_FIELD_NUMBER: _ClassVar[int]
    AR_GRID_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    ar_prefill_ms: float
    ar_decode_ms: float
    ar_tokens: int
    condition_transfer_ms: float
    dit_queue_ms: float
    denoise_ms: float
    vae_decode_ms: float
    encode_ms: float
    total_ms: float
    transformer_calls: int
    preview_ms: float
    dit_steps_computed: int
    dit_steps_skipped: int
    ar_forwards: int
    ar_grid_width: int
    ar_grid_height: int
    def __init__(self, ar_prefill_ms: _Optional[float] = ..., ar_decode_ms: _Optional[float] = ..., ar_tokens: _Optional[int] = ..., condition_transfer_ms: _Optional[float] = ..., dit_queue_ms: _Optional[float] = ..., denoise_ms: _Optional[float] = ..., vae_decode_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., transformer_calls: _Optional[int] = ..., preview_ms: _Optional[float] = ..., dit_steps_computed: _Optional[int] = ..., dit_steps_skipped: _Optional[int] = ..., ar_forwards: _Optional[int] = ..., ar_grid_width: _Optional[int] = ..., ar_grid_height: _Optional[int] = ...) -> None: ...

class GeneratedImage(_message.Message):
    __slots__ = ("index", "seed", "format", "data", "width", "height")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    index: int
    seed: int
    format: OutputFormat
    data: bytes
    width: int
    height: int
    def __init__(self, index: _Optional[int] = ..., seed: _Optional[int] = ..., format: _Optional[_Union[OutputFormat, str]] = ..., data: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class PreviewImage(_message.Message):
    __slots__ = ("index", "partial_index", "step", "total", "format", "data", "width", "height")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    index: int
    partial_index: int
    step: int
    total: int
    format: OutputFormat
    data: bytes
    width: int
    height: int
    def __init__(self, index: _Optional[int] = ..., partial_index: _Optional[int] = ..., step: _Optional[int] = ..., total: _Optional[int] = ..., format: _Optional[_Union[OutputFormat, str]] = ..., data: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("index", "stage", "step", "total")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    index: int
    stage: str
    step: int
    total: int
    def __init__(self, index: _Optional[int] = ..., stage: _Optional[str] = ..., step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("name", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("queued", "running", "queue_capacity", "max_batch_size", "admitted_total", "rejected_total", "cancelled_total", "completed_total", "largest_batch", "batched_steps_total", "render_fault")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LARGEST_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCHED_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RENDER_FAULT_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    queue_capacity: int
    max_batch_size: int
    admitted_total: int
    rejected_total: int
    cancelled_total: int
    completed_total: int
    largest_batch: int
    batched_steps_total: int
    render_fault: str
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., admitted_total: _Optional[int] = ..., rejected_total: _Optional[int] = ..., cancelled_total: _Optional[int] = ..., completed_total: _Optional[int] = ..., largest_batch: _Optional[int] = ..., batched_steps_total: _Optional[int] = ..., render_fault: _Optional[str] = ...) -> None: ...

class ImageChunk(_message.Message):
    __slots__ = ("index", "data", "last")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    last: bool
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...
