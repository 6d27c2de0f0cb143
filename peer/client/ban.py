"""`anchormesh ban PEER`: the operator shuts a peer's key out of the run (or readmits it).

It reads the tracker's address, the operator key and the run CA from the bootstrap's
bootstrap.json: only whoever can read that file (mode 0600) may ban.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc

from peer.errors import ConfigError
from peer.security import auth
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg


def run_ban(bootstrap_json: Path, peer: str, reason: str = "", unban: bool = False) -> int:
    try:
        info = json.loads(bootstrap_json.read_text())
        tracker, operator = info["tracker"], info["operator"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            "--bootstrap", str(bootstrap_json), f"not a readable bootstrap.json with the operator key ({exc})"
        ) from None
    tls_ca = info["tls_ca"].encode() if info.get("tls_ca") else None
    with auth.tracker_channel(tracker, auth.Credentials(operator=operator), tls_ca=tls_ca) as channel:
        try:
            reply = pbg.TrackerStub(channel).Ban(pb.BanRequest(peer_id=peer, reason=reason, unban=unban), timeout=10)
        except grpc.RpcError as exc:
            print(f"anchormesh ban: the tracker at {tracker} said {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(("readmitted " if unban else "banned ") + peer)
    print("banned keys now: " + ("; ".join(reply.banned) or "none"))
    return 0
