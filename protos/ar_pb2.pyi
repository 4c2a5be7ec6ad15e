from google.protobuf import struct_pb2 as _struct_pb2
from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateImageRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "negative_prompt", "width", "height", "n", "seed", "output_format", "output_compression", "quality", "knobs", "partial_images")
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    n: int
    seed: int
    output_format: _common_pb2.OutputFormat
    output_compression: int
    quality: str
    knobs: _containers.MessageMap[str, _struct_pb2.Value]
    partial_images: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., output_format: _Optional[_Union[_common_pb2.OutputFormat, str]] = ..., output_compression: _Optional[int] = ..., quality: _Optional[str] = ..., knobs: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., partial_images: _Optional[int] = ...) -> None: ...

class EditImageInput(_message.Message):
    __slots__ = ("request", "image")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    request: GenerateImageRequest
    image: _common_pb2.ImageChunk
    def __init__(self, request: _Optional[_Union[GenerateImageRequest, _Mapping]] = ..., image: _Optional[_Union[_common_pb2.ImageChunk, _Mapping]] = ...) -> None: ...

class GenerateImageResponse(_message.Message):
    __slots__ = ("request_id", "model", "images", "seed", "width", "height", "timings", "knobs")
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.GeneratedImage]
    seed: int
    width: int
    height: int
    timings: _common_pb2.StageTimings
    knobs: _containers.MessageMap[str, _struct_pb2.Value]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.GeneratedImage, _Mapping]]] = ..., seed: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.StageTimings, _Mapping]] = ..., knobs: _Optional[_Mapping[str, _struct_pb2.Value]] = ...) -> None: ...

class ImageEvent(_message.Message):
    __slots__ = ("progress", "image", "completed", "started", "preview")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    image: _common_pb2.GeneratedImage
    completed: GenerateImageResponse
    started: StreamStarted
    preview: _common_pb2.PreviewImage
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., image: _Optional[_Union[_common_pb2.GeneratedImage, _Mapping]] = ..., completed: _Optional[_Union[GenerateImageResponse, _Mapping]] = ..., started: _Optional[_Union[StreamStarted, _Mapping]] = ..., preview: _Optional[_Union[_common_pb2.PreviewImage, _Mapping]] = ...) -> None: ...

class StreamStarted(_message.Message):
    __slots__ = ("request_id", "model", "seed", "width", "height", "n", "knobs", "prompt_tokens", "image_tokens", "grid_rows")
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    seed: int
    width: int
    height: int
    n: int
    knobs: _containers.MessageMap[str, _struct_pb2.Value]
    prompt_tokens: int
    image_tokens: int
    grid_rows: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., seed: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., n: _Optional[int] = ..., knobs: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., prompt_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., grid_rows: _Optional[int] = ...) -> None: ...

class VisualTokenRow(_message.Message):
    __slots__ = ("index", "seed", "grid_width", "grid_height", "row", "token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRID_WIDTH_FIELD_NUMBER: _ClassVar[int]
    GRID_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    seed: int
    grid_width: int
    grid_height: int
    row: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., seed: _Optional[int] = ..., grid_width: _Optional[int] = ..., grid_height: _Optional[int] = ..., row: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KnobSpec(_message.Message):
    __slots__ = ("name", "type", "default", "minimum", "maximum", "choices", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    MINIMUM_FIELD_NUMBER: _ClassVar[int]
    MAXIMUM_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    default: _struct_pb2.Value
    minimum: float
    maximum: float
    choices: _containers.RepeatedScalarFieldContainer[str]
    description: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., minimum: _Optional[float] = ..., maximum: _Optional[float] = ..., choices: _Optional[_Iterable[str]] = ..., description: _Optional[str] = ...) -> None: ...

class GridRule(_message.Message):
    __slots__ = ("rule", "tokens", "pixels_per_token")
    RULE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIXELS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    rule: str
    tokens: int
    pixels_per_token: int
    def __init__(self, rule: _Optional[str] = ..., tokens: _Optional[int] = ..., pixels_per_token: _Optional[int] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "family", "default_width", "default_height", "max_side", "size_multiple", "max_prompt_tokens", "knobs", "quality_steps", "max_upscale", "grid", "member")
    class QualityStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_SIDE_FIELD_NUMBER: _ClassVar[int]
    SIZE_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_UPSCALE_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    id: str
    family: str
    default_width: int
    default_height: int
    max_side: int
    size_multiple: int
    max_prompt_tokens: int
    knobs: _containers.RepeatedCompositeFieldContainer[KnobSpec]
    quality_steps: _containers.ScalarMap[str, int]
    max_upscale: int
    grid: GridRule
    member: str
    def __init__(self, id: _Optional[str] = ..., family: _Optional[str] = ..., default_width: _Optional[int] = ..., default_height: _Optional[int] = ..., max_side: _Optional[int] = ..., size_multiple: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., knobs: _Optional[_Iterable[_Union[KnobSpec, _Mapping]]] = ..., quality_steps: _Optional[_Mapping[str, int]] = ..., max_upscale: _Optional[int] = ..., grid: _Optional[_Union[GridRule, _Mapping]] = ..., member: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...
