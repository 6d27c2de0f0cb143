"""Starting a stage group's hivemind averaging process: its matchmaking and streaming settings,
and the fork that now and then never comes back.

Apart from the round driver (group.py) because starting is its own failure: hivemind forks its
averaging process, and a fork beside live threads (gRPC's, the DHT client's) sometimes leaves the
child stuck before it is ready, or the parent stuck in the fork itself; this module bounds both
(peer/stall.py) and forks again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from peer.dp.hivemind_averager import absmax_8bit, averager_class
from peer.dp.signed_claims import ClaimSigner
from peer.errors import AnchormeshError
from peer.stall import stall_watch

log = logging.getLogger(__name__)

START_TIMEOUT_S, START_TRIES = 30.0, 3  # the averaging process normally starts in 1-3 s
FORK_STALL_S = 15.0  # a parent still inside run_in_background this long after its wait ended is stuck in the fork
# hivemind matchmaking: the leader forms the group when its declared window ends (it cannot know
# the group's size), polling the DHT without pause until then: a round costs at least
# MIN_MATCHMAKING_S of that. 1 s, not 2: members now arrive within about a step of each other, and
# the first window is stretched to cover that step (`match_window_s`). A join request is answered
# within REQUEST_TIMEOUT_S (hivemind wants it below the window, or two requests can deadlock)
MIN_MATCHMAKING_S, REQUEST_TIMEOUT_S = 1.0, 0.8
# hivemind waits for the next chunk of a member's all-reduce stream without limit by default, so
# one silent member (stalled, gone without closing its streams) held the round until it counted as
# stuck (STUCK_ROUND_FACTOR timeouts). A sender silent this long is left out (a reducer twice as
# long); the round goes on without it (`claims.left_out`, `RoundResult.lost`). A part is at most 512 KiB:
# 0.4 s on the slowest link allowed, so the floor is for a busy CPU, not the wire.
NEXT_CHUNK_S = 15.0


def start_averager(
    params: list[torch.nn.Parameter],
    dht,
    prefix: str,
    compression: str,
    signer: ClaimSigner | None,
    on_stuck: Callable[[], None] | None,
):
    """hivemind's averager of host copies of `params` (zeros for meta ones), matchmaking under
    `prefix`, running in its own process; `compression` "int8" sends 8-bit values, else fp32.
    Tries `START_TRIES` forks of `START_TIMEOUT_S` each, then raises AnchormeshError; `on_stuck`
    as in `GroupAverager`."""
    from hivemind.compression import NoCompression

    for attempt in range(1, START_TRIES + 1):
        averager = averager_class()(
            # host copies (hivemind puts them in shared memory for its forked process, which
            # must never touch CUDA); the base and the offered copy stay where the weights are
            [torch.zeros(p.shape, dtype=p.dtype) if p.is_meta else p.detach().to("cpu", copy=True) for p in params],
            dht,
            start=False,
            prefix=prefix,
            target_group_size=None,
            min_group_size=2,
            min_matchmaking_time=MIN_MATCHMAKING_S,
            request_timeout=REQUEST_TIMEOUT_S,
            next_chunk_timeout=NEXT_CHUNK_S,
            compression=absmax_8bit() if compression == "int8" else NoCompression(),
            allow_state_sharing=False,  # a joiner's state comes over the Stage service
            signer=signer,
        )
        try:
            # hivemind forks its averaging process; a fork beside live threads (gRPC's, the DHT
            # client's) now and then leaves the child stuck before it is ready, and hivemind
            # would wait for it forever: wait a bounded time, then kill it and fork again.
            # Rarer, the parent never returns from the fork itself: `on_stuck` (the daemon
            # starts its process again) is called from a watchdog, and where that cannot run
            # (the GIL held inside fork) the daemon's process ends itself (see peer/stall.py)
            with stall_watch(
                START_TIMEOUT_S + FORK_STALL_S,
                "forking the stage-group averaging process",
                on_stuck or (lambda: None),
                exit_after_s=START_TIMEOUT_S + 2 * FORK_STALL_S if on_stuck else None,
            ):
                averager.run_in_background(await_ready=True, timeout=START_TIMEOUT_S)
            break
        except TimeoutError:
            log.warning(
                "the stage-group averaging process did not start within %.0fs (try %d of %d); starting it again",
                START_TIMEOUT_S,
                attempt,
                START_TRIES,
            )
            averager.kill()
            averager.join(5)
    else:
        raise AnchormeshError(
            f"the stage-group averaging process did not start in {START_TRIES} tries of {START_TIMEOUT_S:.0f}s"
        )
    return averager
