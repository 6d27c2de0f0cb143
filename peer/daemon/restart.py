"""Starting the peer again from a clean process: after a MOVE, or when a fork hangs (peer/stall.py).

Why: hivemind starts its averaging process by `fork()`. Now and then (under load, on 2 cores,
with the DHT's and gRPC's threads alive) the parent never comes back from the fork itself; the
peer then stays "joining" forever and its stage's neighbours wait for it. Nothing inside the
process can undo that, but an `exec` of the same command from another thread can: the peer comes
back with the same id and key (the tracker takes that as a restart), and its forked children die
with their parent thread (peer/daemon/orphans.py). The same exec serves a MOVE to another stage.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

from peer.daemon.startup import STARTED_ENV
from peer.security.identity import IDENTITY_ENV

PEER_ID_ENV = "ANCHORMESH_PEER_ID"  # set before an exec so the peer keeps its id


def exec_again(peer_id: str, identity_hex: str | None) -> NoReturn:
    """Replace this process by the same command, keeping the peer's id (and its key, where no state
    dir holds it: `identity_hex`)."""
    os.environ.update({PEER_ID_ENV: peer_id, STARTED_ENV: repr(time.time())})  # its startup counts from the exec
    if identity_hex:
        os.environ[IDENTITY_ENV] = identity_hex
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.execv(sys.executable, [sys.executable, "-m", "peer.cli", *sys.argv[1:]])
