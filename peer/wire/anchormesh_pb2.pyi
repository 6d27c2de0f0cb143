from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT8: DType
INT32: DType
INT64: DType
UINT8: DType
INT16: DType

class Compression(_message.Message):
    __slots__ = ("kind", "drop", "mask_seed", "boundary", "step", "micro_batch", "values", "block_size")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[Compression.Kind]
        BERNOULLI_MASK: _ClassVar[Compression.Kind]
    NONE: Compression.Kind
    BERNOULLI_MASK: Compression.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    MASK_SEED_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: Compression.Kind
    drop: float
    mask_seed: int
    boundary: int
    step: int
    micro_batch: int
    values: DType
    block_size: int
    def __init__(self, kind: _Optional[_Union[Compression.Kind, str]] = ..., drop: _Optional[float] = ..., mask_seed: _Optional[int] = ..., boundary: _Optional[int] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., values: _Optional[_Union[DType, str]] = ..., block_size: _Optional[int] = ...) -> None: ...

class TensorPayload(_message.Message):
    __slots__ = ("dtype", "shape", "compression", "payload")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    compression: Compression
    payload: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., compression: _Optional[_Union[Compression, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class MicroBatchHeader(_message.Message):
    __slots__ = ("run_id", "micro_batch_id", "step", "sender", "signature", "boundary", "dense")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    micro_batch_id: int
    step: int
    sender: str
    signature: bytes
    boundary: int
    dense: bool
    def __init__(self, run_id: _Optional[str] = ..., micro_batch_id: _Optional[int] = ..., step: _Optional[int] = ..., sender: _Optional[str] = ..., signature: _Optional[bytes] = ..., boundary: _Optional[int] = ..., dense: _Optional[bool] = ...) -> None: ...

class ActivationChunk(_message.Message):
    __slots__ = ("header", "hidden", "token_ids", "labels", "basis_version", "basis_prior", "basis")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASIS_PRIOR_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    header: MicroBatchHeader
    hidden: TensorPayload
    token_ids: TensorPayload
    labels: TensorPayload
    basis_version: int
    basis_prior: TensorPayload
    basis: TensorPayload
    def __init__(self, header: _Optional[_Union[MicroBatchHeader, _Mapping]] = ..., hidden: _Optional[_Union[TensorPayload, _Mapping]] = ..., token_ids: _Optional[_Union[TensorPayload, _Mapping]] = ..., labels: _Optional[_Union[TensorPayload, _Mapping]] = ..., basis_version: _Optional[int] = ..., basis_prior: _Optional[_Union[TensorPayload, _Mapping]] = ..., basis: _Optional[_Union[TensorPayload, _Mapping]] = ...) -> None: ...

class GradientChunk(_message.Message):
    __slots__ = ("header", "grad")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    header: MicroBatchHeader
    grad: TensorPayload
    def __init__(self, header: _Optional[_Union[MicroBatchHeader, _Mapping]] = ..., grad: _Optional[_Union[TensorPayload, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("micro_batch_id", "ok", "error")
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    micro_batch_id: int
    ok: bool
    error: str
    def __init__(self, micro_batch_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("run_id", "sender")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sender: str
    def __init__(self, run_id: _Optional[str] = ..., sender: _Optional[str] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("peer_id", "stage", "version")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    version: int
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...
