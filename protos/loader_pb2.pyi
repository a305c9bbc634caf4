from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ("shard_start",)
    SHARD_START_FIELD_NUMBER: _ClassVar[int]
    shard_start: int
    def __init__(self, shard_start: _Optional[int] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("id", "name", "num_samples", "fields", "class_list")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    CLASS_LIST_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    num_samples: int
    fields: _containers.RepeatedScalarFieldContainer[str]
    class_list: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., num_samples: _Optional[int] = ..., fields: _Optional[_Iterable[str]] = ..., class_list: _Optional[int] = ...) -> None: ...

class ClassList(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("version", "shards", "pipelines", "custom_pipelines", "min_image_size", "max_image_size", "max_order_samples", "max_inflight_orders", "chunk_bytes", "cancels", "workers", "wires", "local_socket", "host_id", "num_shards", "shard_start", "class_lists", "class_list_start")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_PIPELINES_FIELD_NUMBER: _ClassVar[int]
    MIN_IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_ORDER_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_ORDERS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WIRES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_START_FIELD_NUMBER: _ClassVar[int]
    CLASS_LISTS_FIELD_NUMBER: _ClassVar[int]
    CLASS_LIST_START_FIELD_NUMBER: _ClassVar[int]
    version: str
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    pipelines: _containers.RepeatedScalarFieldContainer[str]
    custom_pipelines: bool
    min_image_size: int
    max_image_size: int
    max_order_samples: int
    max_inflight_orders: int
    chunk_bytes: int
    cancels: bool
    workers: int
    wires: _containers.RepeatedScalarFieldContainer[str]
    local_socket: str
    host_id: str
    num_shards: int
    shard_start: int
    class_lists: _containers.RepeatedCompositeFieldContainer[ClassList]
    class_list_start: int
    def __init__(self, version: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., pipelines: _Optional[_Iterable[str]] = ..., custom_pipelines: _Optional[bool] = ..., min_image_size: _Optional[int] = ..., max_image_size: _Optional[int] = ..., max_order_samples: _Optional[int] = ..., max_inflight_orders: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., cancels: _Optional[bool] = ..., workers: _Optional[int] = ..., wires: _Optional[_Iterable[str]] = ..., local_socket: _Optional[str] = ..., host_id: _Optional[str] = ..., num_shards: _Optional[int] = ..., shard_start: _Optional[int] = ..., class_lists: _Optional[_Iterable[_Union[ClassList, _Mapping]]] = ..., class_list_start: _Optional[int] = ...) -> None: ...

class GetKeysRequest(_message.Message):
    __slots__ = ("shard_id", "start", "count")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    start: int
    count: int
    def __init__(self, shard_id: _Optional[str] = ..., start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class GetKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class Setup(_message.Message):
    __slots__ = ("pipeline", "height", "width", "albumentations_json", "fields", "wire", "shared_memory", "job", "exclusive", "clip_frames", "frame_stride", "clips_per_video")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    ALBUMENTATIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FRAME_STRIDE_FIELD_NUMBER: _ClassVar[int]
    CLIPS_PER_VIDEO_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    height: int
    width: int
    albumentations_json: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    wire: str
    shared_memory: bool
    job: str
    exclusive: bool
    clip_frames: int
    frame_stride: int
    clips_per_video: int
    def __init__(self, pipeline: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., albumentations_json: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ..., wire: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., job: _Optional[str] = ..., exclusive: _Optional[bool] = ..., clip_frames: _Optional[int] = ..., frame_stride: _Optional[int] = ..., clips_per_video: _Optional[int] = ...) -> None: ...

class Order(_message.Message):
    __slots__ = ("order_id", "indices", "seed", "epoch", "shard_ids", "shards")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    order_id: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    epoch: int
    shard_ids: _containers.RepeatedScalarFieldContainer[str]
    shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, order_id: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., shard_ids: _Optional[_Iterable[str]] = ..., shards: _Optional[_Iterable[int]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("order_id",)
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    order_id: int
    def __init__(self, order_id: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("setup", "order", "cancel", "release")
    SETUP_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    setup: Setup
    order: Order
    cancel: Cancel
    release: Release
    def __init__(self, setup: _Optional[_Union[Setup, _Mapping]] = ..., order: _Optional[_Union[Order, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("tickets",)
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    tickets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tickets: _Optional[_Iterable[int]] = ...) -> None: ...

class SharedPayload(_message.Message):
    __slots__ = ("offset", "length", "ticket", "generation_offset", "generation")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    GENERATION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    ticket: int
    generation_offset: int
    generation: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., ticket: _Optional[int] = ..., generation_offset: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class SampleError(_message.Message):
    __slots__ = ("position", "index", "key", "reason")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    position: int
    index: int
    key: str
    reason: str
    def __init__(self, position: _Optional[int] = ..., index: _Optional[int] = ..., key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("order_id", "start", "count", "order_size", "height", "width", "channels", "labels", "errors", "targets", "workers_busy", "encoded_sizes", "shared", "joined")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ORDER_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_BUSY_FIELD_NUMBER: _ClassVar[int]
    ENCODED_SIZES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    order_id: int
    start: int
    count: int
    order_size: int
    height: int
    width: int
    channels: int
    labels: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedCompositeFieldContainer[SampleError]
    targets: _containers.RepeatedCompositeFieldContainer[Targets]
    workers_busy: float
    encoded_sizes: _containers.RepeatedScalarFieldContainer[int]
    shared: SharedPayload
    joined: bool
    def __init__(self, order_id: _Optional[int] = ..., start: _Optional[int] = ..., count: _Optional[int] = ..., order_size: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., labels: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[_Union[SampleError, _Mapping]]] = ..., targets: _Optional[_Iterable[_Union[Targets, _Mapping]]] = ..., workers_busy: _Optional[float] = ..., encoded_sizes: _Optional[_Iterable[int]] = ..., shared: _Optional[_Union[SharedPayload, _Mapping]] = ..., joined: _Optional[bool] = ...) -> None: ...

class TargetArray(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("value", "polygons", "rle", "rle_height", "rle_width", "box")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    POLYGONS_FIELD_NUMBER: _ClassVar[int]
    RLE_FIELD_NUMBER: _ClassVar[int]
    RLE_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    RLE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    value: int
    polygons: _containers.RepeatedCompositeFieldContainer[Polygon]
    rle: _containers.RepeatedScalarFieldContainer[int]
    rle_height: int
    rle_width: int
    box: int
    def __init__(self, value: _Optional[int] = ..., polygons: _Optional[_Iterable[_Union[Polygon, _Mapping]]] = ..., rle: _Optional[_Iterable[int]] = ..., rle_height: _Optional[int] = ..., rle_width: _Optional[int] = ..., box: _Optional[int] = ...) -> None: ...

class Polygon(_message.Message):
    __slots__ = ("xy",)
    XY_FIELD_NUMBER: _ClassVar[int]
    xy: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, xy: _Optional[_Iterable[float]] = ...) -> None: ...

class Targets(_message.Message):
    __slots__ = ("arrays", "error", "mask_offset", "mask_length", "regions")
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MASK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MASK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    arrays: _containers.RepeatedCompositeFieldContainer[TargetArray]
    error: str
    mask_offset: int
    mask_length: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, arrays: _Optional[_Iterable[_Union[TargetArray, _Mapping]]] = ..., error: _Optional[str] = ..., mask_offset: _Optional[int] = ..., mask_length: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "pixels")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    pixels: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., pixels: _Optional[bytes] = ...) -> None: ...
