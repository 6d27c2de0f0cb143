"""The hivemind side of stage-group averaging: the `DecentralizedAverager` subclass a
`GroupAverager` (peer/dp/group.py) drives, what its forked process does first, the fixes to
hivemind's 8-bit quantizer it sends with, and dialling stage mates.

`averager_class()` builds the subclass when called, not at import: hivemind is heavy and is
imported inside. The averager is a process: hivemind forks it (`run_in_background`), and
`after_fork` must be the first thing its `run` does in the child (see its docstring).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


def _fix_hivemind_8bit() -> None:
    """hivemind 1.1's 8-bit `extract` does `int(np.frombuffer(..., count=1))`, which numpy >= 2.4
    refuses (an array of one element is not a scalar): every 8-bit part then fails to decode and
    the averager silently keeps its own values. Replace it with the same code reading the count
    as element 0, only where the round trip is broken; the averager process forks after this."""
    import numpy as np
    from hivemind.compression import CompressionInfo, Uniform8BitQuantization
    from hivemind.compression.quantization import Quantization

    probe = torch.linspace(-1, 1, 64)
    q = Uniform8BitQuantization()
    try:
        q.extract(q.compress(probe, CompressionInfo.from_tensor(probe)))
        return
    except TypeError:
        pass

    def extract(self, serialized_tensor):
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    Quantization.extract = extract


def absmax_8bit():
    """hivemind's uniform 8-bit quantizer with the range set by the largest |value| instead of
    +-3 standard deviations. Why: its clipping moves every tail entry of a delta to the edge bin
    (a biased error of several sigma for exactly the coordinates that moved most); by absmax the
    error is at most one bin, max|x| / 127. Only the sender's rule changes: the message stays
    UNIFORM_8BIT (codebook + indices), so hivemind's receiver decodes it unchanged. It is also
    registered as hivemind's UNIFORM_8BIT serializer, because a reducer sends the averaged part
    back with the registered serializer of the type it received, not with ours."""
    import numpy as np
    from hivemind.compression import Uniform8BitQuantization, serialization
    from hivemind.compression.quantization import average_buckets

    _fix_hivemind_8bit()

    class AbsmaxUniform8Bit(Uniform8BitQuantization):
        def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False):
            x = tensor.detach().float()
            scale = x.abs().max().clamp_min(1e-30) / 127
            quantized = (torch.round(x / scale) + 128).clamp_(0, 255).to(torch.uint8)
            lookup = average_buckets(x, quantized, self.n_bins)
            return quantized.numpy(), np.asarray(lookup, dtype=self.codebook_dtype)

    quantizer = AbsmaxUniform8Bit()
    serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = quantizer  # before the averager process forks
    return quantizer


@dataclass(frozen=True)
class RoundResult:
    """What a finished round hands back to the host process: every member's claim (hivemind's
    gathered data), the audit of what the members sent (peer/dp/audit.py) and the flat ranges (start, end) of the stage's concatenated parameters whose
    results never arrived. Why the ranges: hivemind keeps this peer's own values there and says
    only "received 99.9% results" in its log; a peer that took those values for the group mean
    would move its base (int8 deltas) away from the others' for good."""

    gathered: dict
    lost: tuple[tuple[int, int], ...] = ()
    audit: object = None  # peer/dp/audit.py's Audit of the round (None: no audit was run)


def lost_masks(lost: tuple[tuple[int, int], ...], sizes: list[int]) -> list[torch.Tensor]:
    """Per tensor, a flat bool mask of the coordinates inside `lost` (ranges over all tensors concatenated)."""
    flat = torch.zeros(sum(sizes), dtype=torch.bool)
    for start, end in lost:
        flat[start:end] = True
    return list(flat.split(sizes))


def after_fork() -> None:
    """What the forked averaging process does first, on its main thread, before it starts threads.

    1. Rebuild torch's thread pool. Why: torch marks its pool invalid in a forked child and
       rebuilds it on next use, unguarded; in a process whose parent set a thread count (every
       peer does: 1), each new thread re-applies the count on its first parallel op, so two of
       hivemind's executor threads starting together raced the rebuild and one failed with "pool
       INTERNAL ASSERT FAILED ... Invalid thread pool!": that member's part of the round was lost
       and its mates waited on it (tests/test_group_averager.py reproduces the race in 90 % of forks).
    2. Give hivemind's `SharedBytes` a lock of this process's own. Why: it is a multiprocessing
       lock made at import, so shared by the peer and every child it forks, though what it guards
       (the allocating process's buffer) is per process. A child killed while holding it (a stuck
       averaging process is killed and forked again) left the peer blocked for ever at its next
       MPFuture (seen in the test of that restart, on a loaded machine)."""
    import threading

    from hivemind.utils.mpfuture import SharedBytes

    torch.set_num_threads(torch.get_num_threads())
    SharedBytes._lock = threading.Lock()


def averager_class():
    """hivemind's `DecentralizedAverager` subclassed for a stage group (`StageAverager`): built
    in a function because hivemind is imported inside, when an averager is made, not at import."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2

    from peer.wire import audit_pb2

    class StageAverager(DecentralizedAverager):
        """hivemind's averager whose rounds are for the stage group's members only, and which
        hands its state to nobody (a joiner downloads it over the Stage service, size-capped and
        checked: peer/daemon/replicas.py).

        Why the member gate: hivemind's averaging RPCs (join a round, send a part, download the
        state) answer anyone who can reach this peer's libp2p address, whatever the DHT's access
        tokens say; an outsider could read a round's mean or the stage's weights and optimizer
        state, or feed a round. Once the tracker has named the members (`set_members`, from each
        heartbeat), calls from any other hivemind id are refused, and this peer never sends its
        parts to a group that holds one."""

        def __init__(self, *args, signer=None, **kwargs) -> None:
            self._members: frozenset[str] | None = None  # None: not named yet (nothing refused)
            self._refusals: dict[str, float] = {}
            self._signer = signer  # signs this member's claims (peer/dp/signed_claims.py), in this process
            # root -> Commitment: the current round's (and, while a retried round looks for its
            # group, the earlier try's); each holds a host copy of the stage (memory plan: host)
            self._commitments: dict = {}
            self._current = None  # the commitment of the round in progress
            super().__init__(*args, **kwargs)

        @property
        def _matchmaking(self):
            return self.__dict__.get("_mm")

        @_matchmaking.setter
        def _matchmaking(self, mm) -> None:
            """hivemind makes its matchmaker once, in this process; each search for a group is
            made to commit first (`_commit`), so the claim it sends holds this round's root.
            Why here and not at `step()`: hivemind's `step()` waits in the host (the training
            thread) until `_step` has begun; hashing a big stage there would stall training."""
            look = mm.look_for_group

            async def look_for_group(step):
                await asyncio.get_running_loop().run_in_executor(None, self._commit, step)
                return await look(step)

            mm.look_for_group = look_for_group
            self.__dict__["_mm"] = mm

        def _commit(self, step) -> None:
            """Commit to the values about to be sent and put the root into the step's claim."""
            from peer.dp import audit

            bandwidth, mode, user = self.serializer.loads(step.data_for_gather)
            claim = self.serializer.loads(user)
            if not isinstance(claim, dict):
                return
            sign = None
            if self._signer is not None:
                prefix, me = self.prefix, str(self.peer_id)
                sign = lambda c: self._signer.sign(c, prefix, me, float(c.get("time", time.time())))  # noqa: E731
            c, claim = audit.commit_claim(list(self._averaged_tensors), claim, sign)
            self._commitments = {**({self._current.root: self._current} if self._current else {}), c.root: c}
            self._current = c
            step._data_for_gather = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(claim)])

        async def rpc_reveal(self, request, context):
            """Reveal committed values to a member auditing a round (peer/dp/audit.py)."""
            from peer.dp.audit import answer

            if self._stranger(context, "a request to reveal committed values"):
                return audit_pb2.RevealReply(error="not a member of this stage group")
            return answer(self._commitments, request)

        def set_members(self, members: frozenset[str]) -> None:
            """Host side: hand the member list to the averaging process."""
            self._outer_pipe.send(("_set_members", [members], {}))

        async def _set_members(self, members: frozenset[str]) -> None:  # in the averaging process
            self._members = members

        def _stranger(self, context, what: str) -> bool:
            """Whether the caller is not a member (logged once a minute per caller and call)."""
            who = str(context.remote_id)
            if self._members is None or who in self._members:
                return False
            now = time.monotonic()
            if now - self._refusals.get(f"{who} {what}", -math.inf) > 60.0:
                self._refusals[f"{who} {what}"] = now
                log.warning("stage-group averaging: refused %s from %s: not a member of this stage group", what, who)
            return True

        async def rpc_join_group(self, request, context):
            if self._stranger(context, "a request to join a round"):
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            async for reply in super().rpc_join_group(request, context):
                yield reply

        async def rpc_aggregate_part(self, stream, context):
            if self._stranger(context, "a part to average"):
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            async for reply in super().rpc_aggregate_part(stream, context):
                yield reply

        async def rpc_download_state(
            self, _request, _context
        ):  # hivemind's argument names (its type hints are copied below)
            """Nothing, to anyone: the stage's state goes over the Stage service only."""
            return
            yield  # an async generator, as hivemind calls it

        def run(self) -> None:
            """The forked averaging process: torch's thread pool rebuilt first (`after_fork`)."""
            after_fork()
            super().run()

        async def _aggregate_with_group(self, group_info, *args, **kwargs) -> RoundResult:
            """hivemind's round, with the flat ranges whose results were lost handed back too."""
            from peer.dp.audit import REVEAL_TIMEOUT_S, run_audit

            self._lost: list[tuple[int, int]] = []
            if self._current is not None:  # a round has begun: an earlier try's commitment is nobody's to audit
                self._commitments = {self._current.root: self._current}
            gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)

            async def ask(pid, request):
                return await self.get_stub(self._p2p, pid, namespace=self.prefix).rpc_reveal(
                    request, timeout=REVEAL_TIMEOUT_S
                )

            audit = await run_audit(str(self.peer_id), self._current, gathered, ask)
            return RoundResult(gathered, tuple(self._lost), audit)

        async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
            """hivemind's method with its runner swapped for the trimmed-mean one (peer/dp/robust.py)."""
            from hivemind.averaging.averager import AveragingMode
            from hivemind.utils import get_dht_time
            from hivemind.utils.asyncio import as_aiter, azip

            from peer.dp.robust import runner_class

            group_id = group_info.group_id if group_id is None else group_id
            strangers = [
                str(p) for p in group_info.peer_ids if self._members is not None and str(p) not in self._members
            ]
            if strangers:  # a group led or joined by a non-member: send it nothing
                from hivemind.averaging.partition import AllreduceException

                raise AllreduceException(f"the group includes non-members of this stage group: {', '.join(strangers)}")
            runner = runner_class()(
                p2p=self._p2p,
                servicer_type=type(self),
                prefix=self.prefix,
                tensors=tensors,
                group_id=group_id,
                ordered_peer_ids=group_info.peer_ids,
                **kwargs,
            )
            assert group_id in self._running_groups, (
                f"Group id {group_id} was not registered in _register_allreduce_group"
            )
            self._running_groups[group_id].set_result(runner)
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
            self._lost.extend(runner.lost)

    for name in ("rpc_join_group", "rpc_aggregate_part", "rpc_download_state"):  # hivemind routes RPCs by these hints
        getattr(StageAverager, name).__annotations__ = typing.get_type_hints(getattr(DecentralizedAverager, name))
    StageAverager.rpc_reveal.__annotations__ = {
        "request": audit_pb2.RevealRequest,
        "context": P2PContext,
        "return": audit_pb2.RevealReply,
    }
    return StageAverager


async def _dial(maddrs: list[str], _dht, node) -> int:
    """Runs inside the DHT's process (module level: hivemind pickles it there)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    ok = 0
    for m in maddrs:
        try:
            addr, _, peer = m.rpartition("/p2p/")
            await node.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(addr)])  # hivemind has no public dial
            ok += 1
        except Exception as exc:  # a mate that left meanwhile, a malformed address
            log.info("could not dial stage mate %s: %s: %s", m, type(exc).__name__, exc)
    return ok


def connect_peers(dht, maddrs: list[str], timeout: float = 10.0) -> int:
    """Dial each of `maddrs` (".../p2p/<peer id>") from this DHT node's libp2p daemon; returns how
    many answered. Why: averaging finds its group through DHT lookups, and libp2p's DHT does not
    hand out private or unroutable addresses (LANs, 198.18/15 test beds), so stage mates that
    never dialled each other cannot meet; once connected, each knows the other's address."""
    from functools import partial

    if not maddrs:
        return 0
    return dht.run_coroutine(partial(_dial, list(maddrs)), return_future=True).result(timeout=timeout * len(maddrs))
