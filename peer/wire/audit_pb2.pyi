from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RevealRequest(_message.Message):
    __slots__ = ("root", "leaves")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    root: bytes
    leaves: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, root: _Optional[bytes] = ..., leaves: _Optional[_Iterable[int]] = ...) -> None: ...

class RevealReply(_message.Message):
    __slots__ = ("values", "proof", "error")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    proof: bytes
    error: str
    def __init__(self, values: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...
