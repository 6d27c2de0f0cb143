"""TLS for a run's gRPC (`[security] tls = true`): the bootstrap is the run's certificate authority.

Why a run CA and not operator-supplied certificates: every volunteer's peer is also a server, and
nobody hands out certificates to strangers' home machines. The bootstrap makes a CA once (kept in
its state dir), certifies its own tracker, and certifies each peer's TLS key when the peer joins
with the run token. Clients trust that CA only and check a name, not an address (peers are
reached at addresses nobody can predict): the tracker's certificate alone carries
`TRACKER_NAME`, and clients that dial the tracker check it, so a member's certificate cannot
serve as the tracker; members' certificates carry `PEER_NAME` (what peers check of each other)
and `anchormesh-peer-<id>`. A peer's Stage server starts with a throwaway certificate and takes
its CA-issued one at Join (gRPC's dynamic server credentials); it serves nobody before that.

How a peer gets the CA without anyone handing it out: the tracker's certificate carries the CA's
certificate and the tracker's Ed25519 signature over it (`VOUCH_OID`). A peer that knows the
tracker's key (from the address line, peer/security/exposure.py) reads that certificate in a TLS
handshake that checks nothing, takes the CA only when the signature is the tracker key's and the
certificate is the CA's, and from then on verifies everything against that CA (`fetch_ca`).

TLS protects every message's bytes on the wire; who the caller is stays peer/security/auth.py's job.
"""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID, ObjectIdentifier

from peer.atomic import write_atomic
from peer.errors import ConfigError
from peer.security.identity import SIG_BYTES, Identity, verify

TRACKER_NAME = "anchormesh-tracker"  # only the tracker's certificate carries it
PEER_NAME = "anchormesh-peer"  # every member's certificate carries it (and anchormesh-peer-<id>)
SERVER_NAME = PEER_NAME  # what a client checks unless it dials the tracker
VALID_DAYS = 3650
VOUCH_OID = ObjectIdentifier("1.3.6.1.4.1.55555.7.1")  # private arc: the tracker's signature + the CA's DER
_VOUCH_DOMAIN = b"anchormesh-run-ca\0"


def member_names(peer_id: str) -> list[str]:
    """The DNS names of a member's certificate: `PEER_NAME`, and `anchormesh-peer-<id>` when the id
    makes a DNS label. The prefix keeps any id from naming the tracker."""
    label = peer_id.lower().removeprefix("peer-")
    ok = (
        0 < len(label) <= 40
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        and not label.startswith("-")
        and not label.endswith("-")
    )
    return [PEER_NAME, f"{PEER_NAME}-{label}"] if ok else [PEER_NAME]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_der(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _cert(
    subject: str,
    public,
    issuer: x509.Name,
    signer,
    ca: bool,
    names: list[str] | None = None,
    vouch: bytes | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if names:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
    if vouch:
        b = b.add_extension(x509.UnrecognizedExtension(VOUCH_OID, vouch), critical=False)
    return b.sign(signer, hashes.SHA256())


@dataclass
class RunCA:
    """The run's certificate authority (the bootstrap only)."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def load_or_create(cls, state_dir: Path) -> RunCA:
        key_path, cert_path = state_dir / "tls-ca.key", state_dir / "tls-ca.pem"
        if key_path.exists() and cert_path.exists():
            return cls(
                serialization.load_pem_private_key(key_path.read_bytes(), None),
                x509.load_pem_x509_certificate(cert_path.read_bytes()),
            )
        key = new_key()
        ca = cls(key, _cert(f"{SERVER_NAME} run CA", key.public_key(), _name(f"{SERVER_NAME} run CA"), key, ca=True))
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(key_path, key_pem(key), mode=0o600)
        write_atomic(cert_path, ca.pem)
        return ca

    def issue(self, subject: str, public: bytes, tracker: bool = False, vouch: bytes | None = None) -> bytes:
        """A server certificate (PEM) for the DER public key `public`: the tracker's (`TRACKER_NAME`,
        carrying `vouch` when given) or the member `subject`'s (`member_names`)."""
        try:
            pub = serialization.load_der_public_key(public)
        except ValueError as exc:
            raise ConfigError("tls_public_key", f"{len(public)} bytes", f"not a DER public key: {exc}") from None
        if not isinstance(pub, ec.EllipticCurvePublicKey):
            raise ConfigError("tls_public_key", type(pub).__name__, "must be an EC P-256 key")
        names = [TRACKER_NAME] if tracker else member_names(subject)
        return _cert(
            subject, pub, self.cert.subject, self.key, ca=False, names=names, vouch=vouch if tracker else None
        ).public_bytes(serialization.Encoding.PEM)

    def server_pair(self, subject: str = "tracker", tracker_key: Identity | None = None) -> tuple[bytes, bytes]:
        """(key PEM, certificate PEM) for the tracker's server (it alone carries `TRACKER_NAME`);
        with `tracker_key` the certificate vouches for this CA (`fetch_ca`)."""
        key = new_key()
        vouch = None
        if tracker_key is not None:
            der = self.cert.public_bytes(serialization.Encoding.DER)
            vouch = tracker_key.sign(_VOUCH_DOMAIN + der) + der
        return key_pem(key), self.issue(subject, public_der(key), tracker=True, vouch=vouch)


class PeerServerTLS:
    """A peer's Stage server credentials: a throwaway self-signed pair until Join, then the
    CA-issued certificate (`install`)."""

    def __init__(self) -> None:
        self.key = new_key()
        self._pending: bytes | None = None
        self._lock = threading.Lock()
        placeholder = _cert("unjoined", self.key.public_key(), _name("unjoined"), self.key, ca=False).public_bytes(
            serialization.Encoding.PEM
        )
        first = grpc.ssl_server_certificate_configuration([(key_pem(self.key), placeholder)])
        self.credentials = grpc.dynamic_ssl_server_credentials(first, self._fetch)

    def install(self, cert_pem: bytes) -> None:
        with self._lock:
            self._pending = cert_pem

    def _fetch(self):  # gRPC asks before each handshake; None keeps the current configuration
        with self._lock:
            cert, self._pending = self._pending, None
        return grpc.ssl_server_certificate_configuration([(key_pem(self.key), cert)]) if cert else None


def read_ca(value: str | None) -> bytes | None:
    """--tls-ca's value: a PEM file, or a bootstrap.json holding "tls_ca"; None = plain TCP."""
    from peer.security.flagfile import json_object, read_text

    if not value:
        return None
    text = read_text(value, "--tls-ca", value)
    if text.lstrip().startswith("{"):
        ca = json_object(text, "--tls-ca", value).get("tls_ca")
        if not ca:
            raise ConfigError("--tls-ca", value, 'that JSON has no "tls_ca": the run does not use TLS (security.tls)')
        text = ca
    if "BEGIN CERTIFICATE" not in text:
        raise ConfigError("--tls-ca", value, "not a PEM certificate")
    return text.encode()


def vouched_ca(leaf_der: bytes, tracker_key: bytes) -> bytes:
    """The run CA (PEM) that the tracker's certificate `leaf_der` carries, when the tracker key
    signed it and it issued that certificate; ConfigError saying which check failed."""
    where = "--tracker"
    try:
        leaf = x509.load_der_x509_certificate(leaf_der)
        raw = leaf.extensions.get_extension_for_oid(VOUCH_OID).value.value
    except (ValueError, x509.ExtensionNotFound):
        raise ConfigError(
            where,
            "its TLS certificate",
            "carries no run CA vouched by the tracker (not an anchormesh tracker, or an older version)",
        ) from None
    sig, der = raw[:SIG_BYTES], raw[SIG_BYTES:]
    if not verify(tracker_key, sig, _VOUCH_DOMAIN + der):
        raise ConfigError(
            where,
            "its TLS certificate",
            f"its run CA is not signed by the tracker key {tracker_key.hex()[:16]}...: another run, or someone posing as the tracker",
        )
    ca = x509.load_der_x509_certificate(der)
    try:
        leaf.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise ConfigError(
            where, "its TLS certificate", f"was not issued by the run CA it carries ({type(exc).__name__})"
        ) from None
    return ca.public_bytes(serialization.Encoding.PEM)


def leaf_certificate(address: str, timeout_s: float = 10.0) -> bytes:
    """The DER certificate the server at `host:port` presents; nothing is verified (the caller
    checks what it carries). OSError when nothing answers; ssl.SSLError when it speaks no TLS."""
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])  # what gRPC speaks
    with (
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw,
        ctx.wrap_socket(raw, server_hostname=TRACKER_NAME) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError("the server sent no certificate")
    return der


class PlainTracker(ConfigError):
    """The tracker answered, but not with TLS."""


PLAIN_HINT = "the tracker does not speak TLS: a run off loopback uses TLS unless its bootstrap runs with --insecure-plaintext (then pass --insecure-plaintext too)"


def fetch_ca(address: str, tracker_key: bytes, timeout_s: float = 10.0) -> bytes:
    """The run CA (PEM) of the tracker at `address`, checked against `tracker_key`. OSError when
    the tracker does not answer (the caller retries); ConfigError when it answers wrongly."""
    try:
        der = leaf_certificate(address, timeout_s)
    except ssl.SSLError as exc:
        raise PlainTracker("--tracker", address, f"{PLAIN_HINT} ({exc.reason or exc})") from None
    return vouched_ca(der, tracker_key)
