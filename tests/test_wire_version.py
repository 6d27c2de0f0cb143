"""The wire version moves whenever the bytes do: encoded messages of each codec, from fixed inputs,
are pinned to the version they were made under, so a change to the encoding cannot land without
a new wire version (and a peer of the old one is refused at Join instead of mis-decoding)."""

from __future__ import annotations

import hashlib

import torch

from peer.codec.grad_coder import random_coder
from peer.codec.mask import MaskCodec
from peer.config import MaskConfig
from peer.wire.version import WIRE_EPOCH, build_fields, codecs, wire_version

# wire version -> sha256 of the golden messages below, as this build encodes them
PINNED = {"w2-59f92fc7e8": "ef6eeb95a23403b97ee2c2cc40a8393526165d82bc193bb9351bb5a783c1bfe3"}


def golden() -> str:
    """sha256 over messages of every codec path from fixed inputs (values on a coarse grid, so
    no rounding boundary is met by chance)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(-64, 64, (2, 8, 64), generator=g).float() / 16).contiguous()
    h = hashlib.sha256()
    for cfg in (
        MaskConfig(scheme="mask", drop=0.9, values="int8", seed=3),
        MaskConfig(scheme="mask", drop=0.5, values="fp16", seed=4),
    ):
        h.update(MaskCodec(cfg).encode(x, boundary=1, step=2, micro_batch=3).SerializeToString())
    coder = random_coder(64, 64, seed=7)
    h.update(coder.encode(x, sink=1, dither_seed=11))
    h.update(coder.encode(x, sink=1, dither_seed=11, msg_stats=True))
    h.update(
        random_coder(64, 128, seed=8).encode(x, sink=0, stochastic=True, generator=torch.Generator().manual_seed(5))
    )
    return h.hexdigest()


def test_encoded_messages_are_pinned_to_the_wire_version() -> None:
    version, digest = wire_version(), golden()
    assert version.startswith(f"w{WIRE_EPOCH}-") and len(version) == len("w1-") + 10
    assert version in PINNED, (
        f"the wire version is now {version}: pin it here as PINNED[{version!r}] = {digest!r} (old peers will be refused at Join)"
    )
    assert PINNED[version] == digest, (
        f"the encoding changed (golden {digest}) but the wire version {version} did not: bump WIRE_EPOCH in peer/wire/version.py, then pin the new version"
    )


def test_a_join_request_says_what_the_build_is_and_can_run() -> None:
    fields = build_fields()
    assert (
        fields["wire_version"] == wire_version()
        and set(codecs()) >= {"mask", "lowrank", "transform"}
        and fields["codecs"] == codecs()
    )


def test_a_member_of_another_wire_version_is_refused_on_every_call_naming_both() -> None:
    """Join checks the wire version once; each later call (a stream's first headers included)
    carries it too, so a peer that joined and then changed build cannot mis-decode silently."""
    import grpc
    import pytest

    from peer.security import auth
    from peer.security.identity import Identity, certificate_bytes

    tracker, me = Identity.generate(), Identity.generate()
    gate = auth.Gate({"/anchormesh.v1.Stage/Forward": frozenset({auth.MEMBER})})
    gate.configure("run-w", tracker.public, "t" * 32)
    creds = auth.Credentials(identity=me, certificate=tracker.sign(certificate_bytes("run-w", me.peer_id, me.public)))
    md = dict(creds.metadata("/anchormesh.v1.Stage/Forward"))
    assert gate.check("/anchormesh.v1.Stage/Forward", md, frozenset({auth.MEMBER})).peer_id == me.peer_id
    for other, says in (("w1-0123456789", "w1-0123456789"), (None, "none")):
        md = dict(creds.metadata("/anchormesh.v1.Stage/Forward"))
        if other is None:
            del md[auth.H_WIRE]
        else:
            md[auth.H_WIRE] = other
        with pytest.raises(auth.Refused, match=f"speaks wire version {says}.*this peer {wire_version()}") as exc:
            gate.check("/anchormesh.v1.Stage/Forward", md, frozenset({auth.MEMBER}))
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
