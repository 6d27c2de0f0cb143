"""Signed tracker records: only the bootstrap can publish in the run's DHT where the tracker is.

The tracker's address is stored under `TRACKER_RECORD_KEY` as a dictionary whose subkey is the
signer's Ed25519 public key (hex) and whose value `{"run_id", "tracker", "key", "sig"}` carries the
signer's signature over run id, address, key and the record's DHT expiry (`sign_record`,
`publish_tracker`). Every node refuses plain values, malformed or wrongly signed records and
expiries more than `MAX_RECORD_TTL_S` ahead (so nobody squats the key for long: `check_record`,
`TrackerRecordValidator`); a node that knows the tracker's public key (the bootstrap, a peer given
`bootstrap.json` or `--tracker-key`: peer/security/flagfile.py) refuses every other signer. Why a
signature and not an HMAC under the run token: every member holds the token, so an HMAC could not
tell the bootstrap from a member posing as the tracker.

Apart from dht_auth.py (who may take part in the DHT at all) because it answers another threat:
a member of the run posing as its tracker.
"""

from __future__ import annotations

import logging
import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from peer.security.identity import KEY_BYTES, Identity, verify

log = logging.getLogger("anchormesh.dht")

TRACKER_RECORD_KEY = "anchormesh/tracker"
TRACKER_KEY_ID = DHTID.generate(source=TRACKER_RECORD_KEY).to_bytes()
MAX_RECORD_TTL_S = 300.0  # the bootstrap stores 60 s expiries; far ones are squatting
TRACKER_KEY_ENV = "ANCHORMESH_TRACKER_KEY"


def record_bytes(run_id: str, tracker: str, key_hex: str, expiration: float) -> bytes:
    """What the bootstrap signs: the expiry is in it, so an old record cannot be stored again later."""
    return "\0".join(("anchormesh-tracker-record", run_id, tracker, key_hex, repr(float(expiration)))).encode()


def sign_record(identity: Identity, run_id: str, tracker: str, expiration: float) -> tuple[str, dict]:
    """(subkey, value) of the tracker record for `dht.store(TRACKER_RECORD_KEY, value, expiration, subkey=subkey)`."""
    key_hex = identity.public.hex()
    sig = identity.sign(record_bytes(run_id, tracker, key_hex, expiration)).hex()
    return key_hex, {"run_id": run_id, "tracker": tracker, "key": key_hex, "sig": sig}


def publish_tracker(dht, identity: Identity, run_id: str, tracker: str, ttl_s: float) -> bool:
    """Store the tracker's signed record for `ttl_s` seconds (what the bootstrap does every ttl/3)."""
    from hivemind.utils import get_dht_time

    expiration = get_dht_time() + ttl_s
    subkey, record = sign_record(identity, run_id, tracker, expiration)
    return bool(dht.store(TRACKER_RECORD_KEY, record, expiration, subkey=subkey))


def check_record(
    subkey: object,
    value: object,
    expiration: float,
    tracker_key: bytes | None = None,
    run_id: str | None = None,
    now: float | None = None,
) -> str | None:
    """Why this tracker record is refused (None: it is the tracker's, or with no `tracker_key`, a
    well-signed one). `now` bounds the expiry (None: not checked)."""
    if (
        not isinstance(value, dict)
        or set(value) != {"run_id", "tracker", "key", "sig"}
        or not all(isinstance(v, str) for v in value.values())
    ):
        return "not a signed tracker record (a plain value, or fields missing)"
    if subkey != value["key"]:
        return "its subkey is not its signer's key"
    try:
        key, sig = bytes.fromhex(value["key"]), bytes.fromhex(value["sig"])
    except ValueError:
        return "key or signature is not hex"
    if len(key) != KEY_BYTES:
        return "the signer's key is not an Ed25519 key"
    if now is not None and expiration > now + MAX_RECORD_TTL_S:
        return f"expires {expiration - now:.0f}s ahead (at most {MAX_RECORD_TTL_S:.0f}s)"
    if not verify(key, sig, record_bytes(value["run_id"], value["tracker"], value["key"], expiration)):
        return "bad signature"
    if tracker_key is not None and key != tracker_key:
        return f"signed by {value['key'][:16]}..., not by this run's tracker key {tracker_key.hex()[:16]}..."
    if run_id is not None and value["run_id"] != run_id:
        return f"for run {value['run_id'][:40]!r}, not {run_id!r}"
    return None


def verified_trackers(
    found: object, tracker_key: bytes | None = None, run_id: str | None = None
) -> tuple[list[tuple[float, dict]], list[tuple[str, str]]]:
    """What `dht.get(TRACKER_RECORD_KEY, latest=True)` returned, checked again here (a node's
    validator may not know the key): ([(expiry, record)] newest first, [(signer, why refused)])."""
    value = getattr(found, "value", None)
    if found is None:
        return [], []
    if not isinstance(value, dict):
        return [], [("?", "not a signed tracker record (a plain value)")]
    good, refused, now = [], [], time.time()
    for subkey, item in value.items():
        record, expiration = getattr(item, "value", None), float(getattr(item, "expiration_time", 0.0))
        problem = check_record(subkey, record, expiration, tracker_key, run_id, now)
        if problem is None:
            good.append((expiration, record))
        else:
            refused.append((str(subkey)[:16], problem))
    good.sort(key=lambda g: g[0], reverse=True)
    return good, refused


class TrackerRecordValidator(RecordValidatorBase):
    """hivemind checks every record a node stores or receives with it; for the tracker key it
    applies `check_record` (pinned to `tracker_key` when this node knows it). The run id is
    left to `find_tracker`: the signature already names the run's tracker."""

    def __init__(self, tracker_key: bytes | None = None) -> None:
        self.tracker_key = tracker_key

    def validate(self, record: DHTRecord) -> bool:
        if record.key != TRACKER_KEY_ID:
            return True
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except Exception:  # msgpack raises several kinds on junk
            subkey = value = None
        problem = check_record(subkey, value, record.expiration_time, self.tracker_key, now=time.time())
        if problem:
            log.debug("refused a tracker record: %s", problem)
        return problem is None

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, TrackerRecordValidator) and other.tracker_key == self.tracker_key
