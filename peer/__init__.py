"""anchormesh peer: the daemon and the training core (stages, codec, DP sync, anchor, optimizer)."""

import os

__version__ = "0.1.0"

# gRPC's own fork handlers (on by default in grpcio's core) run inside fork() while the forking
# thread holds the GIL, and, when no other thread is in a gRPC call, stop gRPC's threads and wait
# for them: the one in-process waiter we know of at the spot where a peer forking hivemind's
# averager beside a live channel was seen stuck for minutes. No child of ours uses
# gRPC, so they are not needed. Set before any module loads grpc; a user's own value is kept.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
