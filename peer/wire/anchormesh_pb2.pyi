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
    __slots__ = ("kind", "drop", "mask_seed", "boundary", "step", "micro_batch", "values", "block_size", "coder_version", "sink", "dense_rows", "row_bits")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[Compression.Kind]
        BERNOULLI_MASK: _ClassVar[Compression.Kind]
        TRANSFORM: _ClassVar[Compression.Kind]
    NONE: Compression.Kind
    BERNOULLI_MASK: Compression.Kind
    TRANSFORM: Compression.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    MASK_SEED_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CODER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    DENSE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BITS_FIELD_NUMBER: _ClassVar[int]
    kind: Compression.Kind
    drop: float
    mask_seed: int
    boundary: int
    step: int
    micro_batch: int
    values: DType
    block_size: int
    coder_version: int
    sink: int
    dense_rows: _containers.RepeatedScalarFieldContainer[int]
    row_bits: int
    def __init__(self, kind: _Optional[_Union[Compression.Kind, str]] = ..., drop: _Optional[float] = ..., mask_seed: _Optional[int] = ..., boundary: _Optional[int] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., values: _Optional[_Union[DType, str]] = ..., block_size: _Optional[int] = ..., coder_version: _Optional[int] = ..., sink: _Optional[int] = ..., dense_rows: _Optional[_Iterable[int]] = ..., row_bits: _Optional[int] = ...) -> None: ...

class TransformCoder(_message.Message):
    __slots__ = ("version", "mean", "rotation", "std", "bits", "rotation_scale", "run_rotation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    ROTATION_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    ROTATION_SCALE_FIELD_NUMBER: _ClassVar[int]
    RUN_ROTATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    mean: TensorPayload
    rotation: TensorPayload
    std: TensorPayload
    bits: bytes
    rotation_scale: TensorPayload
    run_rotation: bool
    def __init__(self, version: _Optional[int] = ..., mean: _Optional[_Union[TensorPayload, _Mapping]] = ..., rotation: _Optional[_Union[TensorPayload, _Mapping]] = ..., std: _Optional[_Union[TensorPayload, _Mapping]] = ..., bits: _Optional[bytes] = ..., rotation_scale: _Optional[_Union[TensorPayload, _Mapping]] = ..., run_rotation: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("run_id", "micro_batch_id", "step", "sender", "signature", "boundary", "dense", "eval")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    micro_batch_id: int
    step: int
    sender: str
    signature: bytes
    boundary: int
    dense: bool
    eval: bool
    def __init__(self, run_id: _Optional[str] = ..., micro_batch_id: _Optional[int] = ..., step: _Optional[int] = ..., sender: _Optional[str] = ..., signature: _Optional[bytes] = ..., boundary: _Optional[int] = ..., dense: _Optional[bool] = ..., eval: _Optional[bool] = ...) -> None: ...

class ActivationChunk(_message.Message):
    __slots__ = ("header", "hidden", "token_ids", "labels", "basis_version", "basis_prior", "basis", "basis_prior_ids", "coder")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASIS_PRIOR_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    BASIS_PRIOR_IDS_FIELD_NUMBER: _ClassVar[int]
    CODER_FIELD_NUMBER: _ClassVar[int]
    header: MicroBatchHeader
    hidden: TensorPayload
    token_ids: TensorPayload
    labels: TensorPayload
    basis_version: int
    basis_prior: TensorPayload
    basis: TensorPayload
    basis_prior_ids: TensorPayload
    coder: TransformCoder
    def __init__(self, header: _Optional[_Union[MicroBatchHeader, _Mapping]] = ..., hidden: _Optional[_Union[TensorPayload, _Mapping]] = ..., token_ids: _Optional[_Union[TensorPayload, _Mapping]] = ..., labels: _Optional[_Union[TensorPayload, _Mapping]] = ..., basis_version: _Optional[int] = ..., basis_prior: _Optional[_Union[TensorPayload, _Mapping]] = ..., basis: _Optional[_Union[TensorPayload, _Mapping]] = ..., basis_prior_ids: _Optional[_Union[TensorPayload, _Mapping]] = ..., coder: _Optional[_Union[TransformCoder, _Mapping]] = ...) -> None: ...

class GradientChunk(_message.Message):
    __slots__ = ("header", "grad", "coder")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    CODER_FIELD_NUMBER: _ClassVar[int]
    header: MicroBatchHeader
    grad: TensorPayload
    coder: TransformCoder
    def __init__(self, header: _Optional[_Union[MicroBatchHeader, _Mapping]] = ..., grad: _Optional[_Union[TensorPayload, _Mapping]] = ..., coder: _Optional[_Union[TransformCoder, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("peer_id", "stage", "version", "state", "run_id")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    version: int
    state: str
    run_id: str
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., version: _Optional[int] = ..., state: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: TensorPayload
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[TensorPayload, _Mapping]] = ...) -> None: ...

class AnchorPrior(_message.Message):
    __slots__ = ("header", "stage", "grads", "loss")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    header: MicroBatchHeader
    stage: int
    grads: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    loss: float
    def __init__(self, header: _Optional[_Union[MicroBatchHeader, _Mapping]] = ..., stage: _Optional[int] = ..., grads: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., loss: _Optional[float] = ...) -> None: ...

class ShardRequest(_message.Message):
    __slots__ = ("run_id", "sender", "what", "stage", "sketch_seed", "sketch_size")
    class What(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WEIGHTS: _ClassVar[ShardRequest.What]
        STATE: _ClassVar[ShardRequest.What]
        SKETCH: _ClassVar[ShardRequest.What]
    WEIGHTS: ShardRequest.What
    STATE: ShardRequest.What
    SKETCH: ShardRequest.What
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sender: str
    what: ShardRequest.What
    stage: int
    sketch_seed: int
    sketch_size: int
    def __init__(self, run_id: _Optional[str] = ..., sender: _Optional[str] = ..., what: _Optional[_Union[ShardRequest.What, str]] = ..., stage: _Optional[int] = ..., sketch_seed: _Optional[int] = ..., sketch_size: _Optional[int] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("run_id", "peer_id", "stage", "num_stages", "step", "total_bytes", "offset", "data", "names")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer_id: str
    stage: int
    num_stages: int
    step: int
    total_bytes: int
    offset: int
    data: bytes
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., step: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "peer_id", "grpc_address", "code_version", "dht_maddrs", "tls_public_key", "device", "memory_bytes", "stage_memory_bytes", "wire_version", "codecs")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DHT_MADDRS_FIELD_NUMBER: _ClassVar[int]
    TLS_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer_id: str
    grpc_address: str
    code_version: str
    dht_maddrs: _containers.RepeatedScalarFieldContainer[str]
    tls_public_key: bytes
    device: str
    memory_bytes: int
    stage_memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    wire_version: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., code_version: _Optional[str] = ..., dht_maddrs: _Optional[_Iterable[str]] = ..., tls_public_key: _Optional[bytes] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., stage_memory_bytes: _Optional[_Iterable[int]] = ..., wire_version: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("run_id", "stage", "num_stages", "layer_start", "layer_end", "run_config_json", "heartbeat_interval_s", "start_step", "dht_maddrs", "group_dht_maddrs", "certificate", "tracker_key", "calls_per_s", "messages_per_s", "tls_certificate", "anchors_issued", "restore_from", "donors", "data_manifest", "data_windows", "data_hub")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    DHT_MADDRS_FIELD_NUMBER: _ClassVar[int]
    GROUP_DHT_MADDRS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    TRACKER_KEY_FIELD_NUMBER: _ClassVar[int]
    CALLS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TLS_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_ISSUED_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FROM_FIELD_NUMBER: _ClassVar[int]
    DONORS_FIELD_NUMBER: _ClassVar[int]
    DATA_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    DATA_HUB_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    run_config_json: str
    heartbeat_interval_s: float
    start_step: int
    dht_maddrs: _containers.RepeatedScalarFieldContainer[str]
    group_dht_maddrs: _containers.RepeatedScalarFieldContainer[str]
    certificate: bytes
    tracker_key: bytes
    calls_per_s: float
    messages_per_s: float
    tls_certificate: bytes
    anchors_issued: int
    restore_from: PeerInfo
    donors: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    data_manifest: str
    data_windows: int
    data_hub: str
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., run_config_json: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., start_step: _Optional[int] = ..., dht_maddrs: _Optional[_Iterable[str]] = ..., group_dht_maddrs: _Optional[_Iterable[str]] = ..., certificate: _Optional[bytes] = ..., tracker_key: _Optional[bytes] = ..., calls_per_s: _Optional[float] = ..., messages_per_s: _Optional[float] = ..., tls_certificate: _Optional[bytes] = ..., anchors_issued: _Optional[int] = ..., restore_from: _Optional[_Union[PeerInfo, _Mapping]] = ..., donors: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., data_manifest: _Optional[str] = ..., data_windows: _Optional[int] = ..., data_hub: _Optional[str] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "stage", "address", "state", "last_seen_s", "tokens_per_s", "bytes_in", "bytes_out", "step", "loss", "queue_depth", "reason", "dp_rounds", "anchor_id", "anchor_bytes_out", "capacity_tokens_per_s", "dp_bytes_out", "dp_dense_bytes", "eval_id", "eval_loss", "dp_rejected", "refused_calls", "key_fingerprint", "dp_suspects", "dp_flagged", "link_mbit", "pp_keep", "dp_period_s", "device", "memory_bytes", "memory_plan_bytes", "refused_reports", "excluding", "startup_s", "replica_stage", "replica_step", "resumed_from", "startup_phases", "refused_donors", "donor_flagged", "pp_state_bytes_out", "build", "refused_senders", "dropped_steps", "links_held")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DP_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    DP_DENSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    DP_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CALLS_FIELD_NUMBER: _ClassVar[int]
    KEY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DP_SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    DP_FLAGGED_FIELD_NUMBER: _ClassVar[int]
    LINK_MBIT_FIELD_NUMBER: _ClassVar[int]
    PP_KEEP_FIELD_NUMBER: _ClassVar[int]
    DP_PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REPORTS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDING_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    STARTUP_PHASES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_DONORS_FIELD_NUMBER: _ClassVar[int]
    DONOR_FLAGGED_FIELD_NUMBER: _ClassVar[int]
    PP_STATE_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    REFUSED_SENDERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LINKS_HELD_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    address: str
    state: str
    last_seen_s: float
    tokens_per_s: float
    bytes_in: int
    bytes_out: int
    step: int
    loss: float
    queue_depth: int
    reason: str
    dp_rounds: int
    anchor_id: int
    anchor_bytes_out: int
    capacity_tokens_per_s: float
    dp_bytes_out: int
    dp_dense_bytes: int
    eval_id: int
    eval_loss: float
    dp_rejected: int
    refused_calls: int
    key_fingerprint: str
    dp_suspects: _containers.RepeatedScalarFieldContainer[str]
    dp_flagged: int
    link_mbit: float
    pp_keep: float
    dp_period_s: float
    device: str
    memory_bytes: int
    memory_plan_bytes: int
    refused_reports: int
    excluding: _containers.RepeatedScalarFieldContainer[str]
    startup_s: float
    replica_stage: int
    replica_step: int
    resumed_from: str
    startup_phases: _containers.RepeatedCompositeFieldContainer[StartupPhase]
    refused_donors: _containers.RepeatedScalarFieldContainer[str]
    donor_flagged: int
    pp_state_bytes_out: int
    build: str
    refused_senders: _containers.RepeatedScalarFieldContainer[str]
    dropped_steps: int
    links_held: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., queue_depth: _Optional[int] = ..., reason: _Optional[str] = ..., dp_rounds: _Optional[int] = ..., anchor_id: _Optional[int] = ..., anchor_bytes_out: _Optional[int] = ..., capacity_tokens_per_s: _Optional[float] = ..., dp_bytes_out: _Optional[int] = ..., dp_dense_bytes: _Optional[int] = ..., eval_id: _Optional[int] = ..., eval_loss: _Optional[float] = ..., dp_rejected: _Optional[int] = ..., refused_calls: _Optional[int] = ..., key_fingerprint: _Optional[str] = ..., dp_suspects: _Optional[_Iterable[str]] = ..., dp_flagged: _Optional[int] = ..., link_mbit: _Optional[float] = ..., pp_keep: _Optional[float] = ..., dp_period_s: _Optional[float] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., memory_plan_bytes: _Optional[int] = ..., refused_reports: _Optional[int] = ..., excluding: _Optional[_Iterable[str]] = ..., startup_s: _Optional[float] = ..., replica_stage: _Optional[int] = ..., replica_step: _Optional[int] = ..., resumed_from: _Optional[str] = ..., startup_phases: _Optional[_Iterable[_Union[StartupPhase, _Mapping]]] = ..., refused_donors: _Optional[_Iterable[str]] = ..., donor_flagged: _Optional[int] = ..., pp_state_bytes_out: _Optional[int] = ..., build: _Optional[str] = ..., refused_senders: _Optional[_Iterable[str]] = ..., dropped_steps: _Optional[int] = ..., links_held: _Optional[_Iterable[str]] = ...) -> None: ...

class StartupPhase(_message.Message):
    __slots__ = ("name", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    seconds: float
    def __init__(self, name: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class PeerReport(_message.Message):
    __slots__ = ("run_id", "peer", "tokens", "windows_held", "windows_returned")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_HELD_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer: PeerInfo
    tokens: int
    windows_held: _containers.RepeatedScalarFieldContainer[int]
    windows_returned: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., peer: _Optional[_Union[PeerInfo, _Mapping]] = ..., tokens: _Optional[int] = ..., windows_held: _Optional[_Iterable[int]] = ..., windows_returned: _Optional[_Iterable[int]] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("kind", "reason", "neighbours", "anchor_id", "anchor_micro_batches", "eval_id", "banned", "banned_dht", "anchors_issued", "member_dht", "replicate", "windows")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CONTINUE: _ClassVar[Directive.Kind]
        STOP: _ClassVar[Directive.Kind]
        MOVE: _ClassVar[Directive.Kind]
    CONTINUE: Directive.Kind
    STOP: Directive.Kind
    MOVE: Directive.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_ID_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    BANNED_DHT_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_ISSUED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_DHT_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    kind: Directive.Kind
    reason: str
    neighbours: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    anchor_id: int
    anchor_micro_batches: int
    eval_id: int
    banned: _containers.RepeatedScalarFieldContainer[str]
    banned_dht: _containers.RepeatedScalarFieldContainer[str]
    anchors_issued: int
    member_dht: _containers.RepeatedScalarFieldContainer[str]
    replicate: PeerInfo
    windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[Directive.Kind, str]] = ..., reason: _Optional[str] = ..., neighbours: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., anchor_id: _Optional[int] = ..., anchor_micro_batches: _Optional[int] = ..., eval_id: _Optional[int] = ..., banned: _Optional[_Iterable[str]] = ..., banned_dht: _Optional[_Iterable[str]] = ..., anchors_issued: _Optional[int] = ..., member_dht: _Optional[_Iterable[str]] = ..., replicate: _Optional[_Union[PeerInfo, _Mapping]] = ..., windows: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "peer_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("run_id", "run_config_json", "code_version", "wire_version", "server_time_unix")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CODE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    run_config_json: str
    code_version: str
    wire_version: str
    server_time_unix: float
    def __init__(self, run_id: _Optional[str] = ..., run_config_json: _Optional[str] = ..., code_version: _Optional[str] = ..., wire_version: _Optional[str] = ..., server_time_unix: _Optional[float] = ...) -> None: ...

class DataRequest(_message.Message):
    __slots__ = ("name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("name", "total_bytes", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BanRequest(_message.Message):
    __slots__ = ("peer_id", "reason", "unban")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNBAN_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    reason: str
    unban: bool
    def __init__(self, peer_id: _Optional[str] = ..., reason: _Optional[str] = ..., unban: _Optional[bool] = ...) -> None: ...

class BanReply(_message.Message):
    __slots__ = ("banned",)
    BANNED_FIELD_NUMBER: _ClassVar[int]
    banned: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, banned: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("index", "peers", "tokens_per_s", "queue_depth", "capacity_tokens_per_s")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    index: int
    peers: int
    tokens_per_s: float
    queue_depth: int
    capacity_tokens_per_s: float
    def __init__(self, index: _Optional[int] = ..., peers: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., queue_depth: _Optional[int] = ..., capacity_tokens_per_s: _Optional[float] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "step", "tokens", "loss", "tokens_per_s", "pp_bytes_per_token", "pp_compression", "uptime_s", "state", "reason", "stages", "peers", "dht_maddrs", "anchor_step", "anchor_age_steps", "anchors_launched", "anchor_bytes_per_token", "stage_moves", "dp_bytes_per_token", "dp_compression", "eval_loss", "eval_step", "refused_calls", "banned", "unfit", "model", "config_digest", "wire_version", "data", "pp_state_bytes_per_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PP_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PP_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DHT_MADDRS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_STEP_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_AGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STAGE_MOVES_FIELD_NUMBER: _ClassVar[int]
    DP_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DP_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CALLS_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    UNFIT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PP_STATE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    tokens: int
    loss: float
    tokens_per_s: float
    pp_bytes_per_token: float
    pp_compression: float
    uptime_s: float
    state: str
    reason: str
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    dht_maddrs: _containers.RepeatedScalarFieldContainer[str]
    anchor_step: int
    anchor_age_steps: int
    anchors_launched: int
    anchor_bytes_per_token: float
    stage_moves: int
    dp_bytes_per_token: float
    dp_compression: float
    eval_loss: float
    eval_step: int
    refused_calls: int
    banned: int
    unfit: _containers.RepeatedScalarFieldContainer[str]
    model: ModelInfo
    config_digest: str
    wire_version: str
    data: DataStatus
    pp_state_bytes_per_token: float
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., tokens: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., pp_bytes_per_token: _Optional[float] = ..., pp_compression: _Optional[float] = ..., uptime_s: _Optional[float] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., dht_maddrs: _Optional[_Iterable[str]] = ..., anchor_step: _Optional[int] = ..., anchor_age_steps: _Optional[int] = ..., anchors_launched: _Optional[int] = ..., anchor_bytes_per_token: _Optional[float] = ..., stage_moves: _Optional[int] = ..., dp_bytes_per_token: _Optional[float] = ..., dp_compression: _Optional[float] = ..., eval_loss: _Optional[float] = ..., eval_step: _Optional[int] = ..., refused_calls: _Optional[int] = ..., banned: _Optional[int] = ..., unfit: _Optional[_Iterable[str]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., config_digest: _Optional[str] = ..., wire_version: _Optional[str] = ..., data: _Optional[_Union[DataStatus, _Mapping]] = ..., pp_state_bytes_per_token: _Optional[float] = ...) -> None: ...

class DataStatus(_message.Message):
    __slots__ = ("source", "epoch", "windows", "position", "done", "tokens_seen", "in_flight", "returned", "eval_windows")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    EVAL_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    source: str
    epoch: int
    windows: int
    position: int
    done: int
    tokens_seen: int
    in_flight: int
    returned: int
    eval_windows: int
    def __init__(self, source: _Optional[str] = ..., epoch: _Optional[int] = ..., windows: _Optional[int] = ..., position: _Optional[int] = ..., done: _Optional[int] = ..., tokens_seen: _Optional[int] = ..., in_flight: _Optional[int] = ..., returned: _Optional[int] = ..., eval_windows: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "num_layers", "hidden_size", "num_stages", "tokenizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    hidden_size: int
    num_stages: int
    tokenizer: str
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_stages: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...
