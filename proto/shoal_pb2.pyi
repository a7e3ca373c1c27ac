from google.protobuf.internal import containers as _containers
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
    __slots__ = ("seq", "layer", "hidden", "rows", "experts")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    layer: int
    hidden: Tensor
    rows: Tensor
    experts: Tensor
    def __init__(self, seq: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., experts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ExpertReply(_message.Message):
    __slots__ = ("seq", "output", "compute_seconds")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    output: Tensor
    compute_seconds: float
    def __init__(self, seq: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("node_id", "fingerprint", "model_type", "protocol_version", "experts", "problems")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fingerprint: str
    model_type: str
    protocol_version: int
    experts: _containers.RepeatedCompositeFieldContainer[HeldExpert]
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., model_type: _Optional[str] = ..., protocol_version: _Optional[int] = ..., experts: _Optional[_Iterable[_Union[HeldExpert, _Mapping]]] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...
