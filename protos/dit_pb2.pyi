from google.protobuf import struct_pb2 as _struct_pb2
from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConditionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONDITION_KIND_UNSPECIFIED: _ClassVar[ConditionKind]
    CONDITION_KIND_TEXT: _ClassVar[ConditionKind]
    CONDITION_KIND_IMAGE: _ClassVar[ConditionKind]
    CONDITION_KIND_NEGATIVE: _ClassVar[ConditionKind]
CONDITION_KIND_UNSPECIFIED: ConditionKind
CONDITION_KIND_TEXT: ConditionKind
CONDITION_KIND_IMAGE: ConditionKind
CONDITION_KIND_NEGATIVE: ConditionKind

class RenderInput(_message.Message):
    __slots__ = ("header", "chunk", "end", "reference")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    header: RenderHeader
    chunk: ConditionChunk
    end: RenderEnd
    reference: _common_pb2.ImageChunk
    def __init__(self, header: _Optional[_Union[RenderHeader, _Mapping]] = ..., chunk: _Optional[_Union[ConditionChunk, _Mapping]] = ..., end: _Optional[_Union[RenderEnd, _Mapping]] = ..., reference: _Optional[_Union[_common_pb2.ImageChunk, _Mapping]] = ...) -> None: ...

class RenderHeader(_message.Message):
    __slots__ = ("request_id", "width", "height", "n", "seed", "output_format", "output_compression", "knobs", "hidden_size", "dtype", "text_positions", "image_positions", "negative_positions", "index_offset", "partial_images", "model", "upscale", "reference_images")
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INDEX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UPSCALE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    width: int
    height: int
    n: int
    seed: int
    output_format: _common_pb2.OutputFormat
    output_compression: int
    knobs: _containers.MessageMap[str, _struct_pb2.Value]
    hidden_size: int
    dtype: str
    text_positions: int
    image_positions: int
    negative_positions: int
    index_offset: int
    partial_images: int
    model: _common_pb2.ModelIdentity
    upscale: int
    reference_images: int
    def __init__(self, request_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., output_format: _Optional[_Union[_common_pb2.OutputFormat, str]] = ..., output_compression: _Optional[int] = ..., knobs: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., text_positions: _Optional[int] = ..., image_positions: _Optional[int] = ..., negative_positions: _Optional[int] = ..., index_offset: _Optional[int] = ..., partial_images: _Optional[int] = ..., model: _Optional[_Union[_common_pb2.ModelIdentity, _Mapping]] = ..., upscale: _Optional[int] = ..., reference_images: _Optional[int] = ...) -> None: ...

class ConditionChunk(_message.Message):
    __slots__ = ("kind", "offset", "hidden_states")
    KIND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    kind: ConditionKind
    offset: int
    hidden_states: _common_pb2.Tensor
    def __init__(self, kind: _Optional[_Union[ConditionKind, str]] = ..., offset: _Optional[int] = ..., hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class RenderEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenderEvent(_message.Message):
    __slots__ = ("progress", "image", "completed", "preview")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    image: _common_pb2.GeneratedImage
    completed: RenderSummary
    preview: _common_pb2.PreviewImage
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., image: _Optional[_Union[_common_pb2.GeneratedImage, _Mapping]] = ..., completed: _Optional[_Union[RenderSummary, _Mapping]] = ..., preview: _Optional[_Union[_common_pb2.PreviewImage, _Mapping]] = ...) -> None: ...

class RenderSummary(_message.Message):
    __slots__ = ("request_id", "seed", "timings", "knobs")
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seed: int
    timings: _common_pb2.StageTimings
    knobs: _containers.MessageMap[str, _struct_pb2.Value]
    def __init__(self, request_id: _Optional[str] = ..., seed: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.StageTimings, _Mapping]] = ..., knobs: _Optional[_Mapping[str, _struct_pb2.Value]] = ...) -> None: ...
