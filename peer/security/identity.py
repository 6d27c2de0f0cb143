"""Identity keys and membership certificates (DESIGN §6).

Why keys and not just the run token: the token says "may join", not "who". Every peer holds an
Ed25519 key (kept in `--state-dir/identity.key`, so a restarted peer is the same peer); its id
is derived from the public key. At Join the tracker signs (run id, peer id, public key) with its
own key; that signature is the peer's *certificate*. Any peer can then check who calls it with
nothing but the tracker's public key (from its Assignment), and a ban names a key, which a
banned peer cannot borrow from another.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from peer.atomic import write_atomic
from peer.errors import ConfigError

KEY_BYTES = 32
SIG_BYTES = 64
IDENTITY_ENV = "ANCHORMESH_IDENTITY"  # hex private key, set by a MOVE's exec when there is no state dir


def fingerprint(public: bytes) -> str:
    """A short stable name of a public key (bans and logs name keys by it)."""
    return hashlib.sha256(public).hexdigest()[:16]


class Identity:
    """An Ed25519 key pair; `peer_id` is derived from the public key."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key().public_bytes_raw()
        self.fingerprint = fingerprint(self.public)
        self.peer_id = f"peer-{self.fingerprint[:8]}"

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> Identity:
        if len(raw) != KEY_BYTES:
            raise ConfigError(
                where,
                f"{len(raw)} bytes",
                f"an identity key is {KEY_BYTES} raw bytes; remove the file to make a new identity",
            )
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """The key in `path`, or a new one written there (mode 0600)."""
        if path.exists():
            return cls.from_bytes(path.read_bytes(), str(path))
        ident = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, ident.private_bytes(), mode=0o600)
        return ident

    @classmethod
    def for_peer(cls, state_dir: Path | None) -> Identity:
        """A peer's identity: kept in its state dir; else the one a MOVE's exec handed over; else new."""
        if state_dir is not None:
            return cls.load_or_create(state_dir / "identity.key")
        if os.environ.get(IDENTITY_ENV):
            return cls.from_bytes(bytes.fromhex(os.environ[IDENTITY_ENV]), IDENTITY_ENV)
        return cls.generate()

    def private_bytes(self) -> bytes:
        return self._private.private_bytes_raw()

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def verify(public: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` is `public`'s over `data` (False for malformed keys or signatures)."""
    if len(public) != KEY_BYTES or len(signature) != SIG_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False


def certificate_bytes(run_id: str, peer_id: str, public: bytes) -> bytes:
    """What the tracker signs to admit `peer_id` with key `public` to `run_id`."""
    return b"anchormesh-member\0" + run_id.encode() + b"\0" + peer_id.encode() + b"\0" + public
