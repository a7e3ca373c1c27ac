from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExpertRequest(_message.Message):
    __slots__ = ("seq", "layer", "hidden", "rows", "experts", "prefetch", "call_pairs")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    CALL_PAIRS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    layer: int
    hidden: Tensor
    rows: Tensor
    experts: Tensor
    prefetch: PrefetchHint
    call_pairs: int
    def __init__(self, seq: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., experts: _Optional[_Union[Tensor, _Mapping]] = ..., prefetch: _Optional[_Union[PrefetchHint, _Mapping]] = ..., call_pairs: _Optional[int] = ...) -> None: ...

class PrefetchHint(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertReply(_message.Message):
    __slots__ = ("seq", "output", "compute_seconds", "inventory_version", "timing")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    seq: int
    output: Tensor
    compute_seconds: float
    inventory_version: int
    timing: WorkerTiming
    def __init__(self, seq: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., inventory_version: _Optional[int] = ..., timing: _Optional[_Union[WorkerTiming, _Mapping]] = ...) -> None: ...

class WorkerTiming(_message.Message):
    __slots__ = ("parse", "matrix", "bookkeeping", "reply", "waited", "reads")
    PARSE_FIELD_NUMBER: _ClassVar[int]
    MATRIX_FIELD_NUMBER: _ClassVar[int]
    BOOKKEEPING_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    parse: float
    matrix: float
    bookkeeping: float
    reply: float
    waited: float
    reads: float
    def __init__(self, parse: _Optional[float] = ..., matrix: _Optional[float] = ..., bookkeeping: _Optional[float] = ..., reply: _Optional[float] = ..., waited: _Optional[float] = ..., reads: _Optional[float] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeldExpert(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("node_id", "fingerprint", "model_type", "protocol_version", "experts", "problems", "memory_budget", "free_disk", "inventory_version", "draining", "lane_port", "streaming", "read_bps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FREE_DISK_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    READ_BPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fingerprint: str
    model_type: str
    protocol_version: int
    experts: _containers.RepeatedCompositeFieldContainer[HeldExpert]
    problems: _containers.RepeatedScalarFieldContainer[str]
    memory_budget: int
    free_disk: int
    inventory_version: int
    draining: _containers.RepeatedCompositeFieldContainer[HeldExpert]
    lane_port: int
    streaming: bool
    read_bps: int
    def __init__(self, node_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., model_type: _Optional[str] = ..., protocol_version: _Optional[int] = ..., experts: _Optional[_Iterable[_Union[HeldExpert, _Mapping]]] = ..., problems: _Optional[_Iterable[str]] = ..., memory_budget: _Optional[int] = ..., free_disk: _Optional[int] = ..., inventory_version: _Optional[int] = ..., draining: _Optional[_Iterable[_Union[HeldExpert, _Mapping]]] = ..., lane_port: _Optional[int] = ..., streaming: _Optional[bool] = ..., read_bps: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DriveStats(_message.Message):
    __slots__ = ("folder", "bytes_read", "reads", "active_seconds", "failed")
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    folder: str
    bytes_read: int
    reads: int
    active_seconds: float
    failed: str
    def __init__(self, folder: _Optional[str] = ..., bytes_read: _Optional[int] = ..., reads: _Optional[int] = ..., active_seconds: _Optional[float] = ..., failed: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("node_id", "memory_budget", "expert_bytes", "resident_bytes", "resident_experts", "held_experts", "passes", "tokens", "demands", "hits", "misses", "prefetch_hits", "prefetch_late", "prefetch_issued", "prefetch_used", "prefetch_cancelled", "prefetch_wasted", "loads", "evictions", "drives", "problems", "read_buffer_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HELD_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEMANDS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_LATE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ISSUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WASTED_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DRIVES_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    READ_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    memory_budget: int
    expert_bytes: int
    resident_bytes: int
    resident_experts: int
    held_experts: int
    passes: int
    tokens: int
    demands: int
    hits: int
    misses: int
    prefetch_hits: int
    prefetch_late: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_cancelled: int
    prefetch_wasted: int
    loads: int
    evictions: int
    drives: _containers.RepeatedCompositeFieldContainer[DriveStats]
    problems: _containers.RepeatedScalarFieldContainer[str]
    read_buffer_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., memory_budget: _Optional[int] = ..., expert_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., resident_experts: _Optional[int] = ..., held_experts: _Optional[int] = ..., passes: _Optional[int] = ..., tokens: _Optional[int] = ..., demands: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., prefetch_hits: _Optional[int] = ..., prefetch_late: _Optional[int] = ..., prefetch_issued: _Optional[int] = ..., prefetch_used: _Optional[int] = ..., prefetch_cancelled: _Optional[int] = ..., prefetch_wasted: _Optional[int] = ..., loads: _Optional[int] = ..., evictions: _Optional[int] = ..., drives: _Optional[_Iterable[_Union[DriveStats, _Mapping]]] = ..., problems: _Optional[_Iterable[str]] = ..., read_buffer_bytes: _Optional[int] = ...) -> None: ...

class HeatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertHeat(_message.Message):
    __slots__ = ("layer", "expert", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    tokens: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class HeatReport(_message.Message):
    __slots__ = ("node_id", "boot_id", "experts")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    experts: _containers.RepeatedCompositeFieldContainer[ExpertHeat]
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., experts: _Optional[_Iterable[_Union[ExpertHeat, _Mapping]]] = ...) -> None: ...

class ExpertFileRequest(_message.Message):
    __slots__ = ("layer", "expert", "offset")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    offset: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ExpertChunk(_message.Message):
    __slots__ = ("layer", "expert", "offset", "data", "total_bytes", "sha256")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    offset: int
    data: bytes
    total_bytes: int
    sha256: str
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ExpertFileState(_message.Message):
    __slots__ = ("layer", "expert", "state", "partial_bytes", "idle_seconds", "inventory_version")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ABSENT: _ClassVar[ExpertFileState.State]
        PARTIAL: _ClassVar[ExpertFileState.State]
        SERVING: _ClassVar[ExpertFileState.State]
        DRAINING: _ClassVar[ExpertFileState.State]
    ABSENT: ExpertFileState.State
    PARTIAL: ExpertFileState.State
    SERVING: ExpertFileState.State
    DRAINING: ExpertFileState.State
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_VERSION_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    state: ExpertFileState.State
    partial_bytes: int
    idle_seconds: float
    inventory_version: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., state: _Optional[_Union[ExpertFileState.State, str]] = ..., partial_bytes: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., inventory_version: _Optional[int] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("layer", "expert", "phase", "quiet_seconds")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[DropRequest.Phase]
        DRAIN: _ClassVar[DropRequest.Phase]
        DELETE: _ClassVar[DropRequest.Phase]
        KEEP: _ClassVar[DropRequest.Phase]
    UNSPECIFIED: DropRequest.Phase
    DRAIN: DropRequest.Phase
    DELETE: DropRequest.Phase
    KEEP: DropRequest.Phase
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    QUIET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    phase: DropRequest.Phase
    quiet_seconds: float
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., phase: _Optional[_Union[DropRequest.Phase, str]] = ..., quiet_seconds: _Optional[float] = ...) -> None: ...
