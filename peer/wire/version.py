"""The wire version: what two peers must share to read each other's messages.

`__version__` names a release; peers built from different commits of one release can still
disagree on the bytes (a quantiser table, a dither key, a proto field), and a receiver that
decodes with another table gets a wrong tensor without an error. So the wire version is derived
from what fixes the encoding: the proto's descriptor (fields and types, not comments), the
codecs' constants, and `WIRE_EPOCH`, which a change to the encoding's code (not its constants)
bumps; tests/test_wire_version.py pins encoded messages to the version so such a change cannot
land without it. The tracker refuses a Join from another wire version, naming both.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache

from peer.config import MASK_SCHEMES

WIRE_EPOCH = 2  # bump when the encoding's code changes what bytes a message holds


def _codec_constants() -> dict[str, object]:
    """The numbers both ends of a link must agree on, by module."""
    from peer.codec import bitpack, mask, row_rates, transform
    from peer.pipeline.codecs import mask as mask_link

    return {
        "transform.STEP": transform.STEP,
        "transform.MSE": transform.MSE,
        "transform.BITS_GRID": transform.BITS_GRID,
        "transform.GRAD_STEP_SCALE": transform.GRAD_STEP_SCALE,
        "transform.MAX_BITS": transform.MAX_BITS,
        "bitpack.SHUFFLE_SALT": bitpack.SHUFFLE_SALT,
        "row_rates.CLASSES": row_rates.CLASSES,
        "row_rates.CLASS_BITS": row_rates.CLASS_BITS,
        "row_rates.SUBSET_SALT": row_rates.SUBSET_SALT,
        "mask.KEY_DOMAIN": mask._KEY_DOMAIN.decode(),
        "mask.GOLDEN": mask._GOLDEN,
        "mask.DEFAULT_BLOCK_SIZE": mask.DEFAULT_BLOCK_SIZE,
        "link_codec.KEEP_GRID": mask_link.KEEP_GRID,
    }


@cache
def wire_version() -> str:
    """`wN-` + 10 hex digits: the epoch and a hash of the proto descriptors and codec constants."""
    from peer.wire import anchormesh_pb2, audit_pb2

    h = hashlib.sha256()
    for module in (anchormesh_pb2, audit_pb2):
        h.update(module.DESCRIPTOR.serialized_pb)
    h.update(json.dumps(_codec_constants(), sort_keys=True, default=str).encode())
    return f"w{WIRE_EPOCH}-{h.hexdigest()[:10]}"


def codecs() -> list[str]:
    """The PP codecs (mask.scheme values) this build can encode and decode."""
    return list(MASK_SCHEMES)


def build_fields() -> dict[str, object]:
    """The JoinRequest fields that say what this build is and can run."""
    from peer.build import build

    return {"code_version": build(), "wire_version": wire_version(), "codecs": codecs()}
