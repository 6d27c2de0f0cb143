"""Parameter averaging inside one stage group over the network (hivemind averaging).

A peer offers its stage parameters to hivemind's DecentralizedAverager (matchmaking over the
run's DHT, keyed by run and stage) about every `every` local steps. The round runs in the
background while the peer keeps training; when it finishes, the peer adds (group mean - what it
offered) to its current weights, so the local steps taken meanwhile are kept (DiLoCo's outer step
with lr 1, applied late). No peer waits for the slowest: a peer alone in its stage, or a round
that finds no group in time, just trains on.

When a round is offered: members of a group have different local step counts (they joined at
different times), so "every `every` local steps" fires at different wall times, and the first
member to offer sat in matchmaking (hivemind polls the DHT without pause: the largest non-model
CPU cost of a swarm) until the others came. Rounds are therefore offered at wall-clock slot
boundaries the group shares (`RoundSchedule`): a peer offers at its first step at which at
least `every` local steps have passed since its last offer (or its start) *and* the clock has
passed a multiple of `period_s` since then (boundaries passed while it could not offer: alone,
its last round pending, or short of its first `every` steps, do not count). `period_s` is the
longer of `every` steps at this peer's step time and the time that keeps the round's bytes to
`link_share` of the link, rounded UP to a power of two seconds: powers of two nest, so members
whose estimates differ by up to 2x still meet at every boundary of the longer period, without
talking. Members then arrive within about a step of each other (their clocks must agree to well
under a step: NTP): the group forms a step after the boundary (`match_window_s`), and a round
that has found nobody after half a period gives up (`match_timeout_s`) instead of polling on.

On the wire (`compression`): "none" averages the fp32 parameters themselves (the uncompressed
baseline); "int8" averages the *change since the last group mean* (the DiLoCo outer delta),
8-bit with hivemind's uniform quantizer. Why deltas: a few steps of change are small and
centred, so 8 bits lose little, while 8-bit parameters would lose most of their mantissa.

Each round also carries every member's *claim*: its id and the values it sends at a fixed sample
of coordinates (hivemind's all-gather rides along with matchmaking). The reduction itself is a
coordinate-wise trimmed mean in which every member weighs 1 (peer/dp/robust.py): in a group of
three or more one member cannot scale or flip the result. Claims let a peer check the result it
gets back (it must equal the same trimmed mean of the claims at those coordinates) and name a
member whose update is NaN, far larger than the group's, or points against the rest of the
group (a sign flip); see `GroupAverager._attribute`.

The same averager hands a stage's state to a peer that joins the group late (hivemind's
`load_state_from_peers`): each peer declares itself a donor with its step count as priority, so
a joiner downloads from the most-trained member; a peer that has not trained yet declares nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import typing
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from peer.dp.robust import trimmed_mean
from peer.errors import AnchormeshError

log = logging.getLogger(__name__)


# bytes per averaged element on the wire (hivemind's 8-bit quantizer adds a 1 KiB codebook per part)
WIRE_BYTES = {"none": 4, "int8": 1}

MAX_CORRECTION = 4.0  # see GroupAverager._implausible
# coordinates of each member's claim: 4 KiB of fp32. It must stay small: hivemind hands the step
# to its averaging process over a non-blocking pipe, and a 16 KiB claim broke that pipe (the
# process died, and step() waited forever); 8 KiB still passed
SAMPLE = 1024
FLIP_COSINE = -0.5  # an update whose cosine with the rest of the group's mean update is below this points against it
CLAIM_TOLERANCE = 0.1  # |mean - mean of claims| may be this fraction of the largest claimed update (8-bit quantization: ~2%)
STUCK_ROUND_FACTOR = 3.0  # a round pending this many times its timeout (plus its transfer time, below) is cancelled
SLOWEST_LINK_BPS = 1.25e6  # 10 Mbit/s: the slowest link a round's bytes are allowed to take before it counts as stuck
START_TIMEOUT_S, START_TRIES = 30.0, 3  # the averaging process normally starts in 1-3 s
# hivemind matchmaking: the leader forms the group when its declared window ends (it cannot know
# the group's size), polling the DHT without pause until then: a round costs at least
# MIN_MATCHMAKING_S of that. 1 s, not 2: members now arrive within about a step of each other, and
# the first window is stretched to cover that step (`match_window_s`). A join request is answered
# within REQUEST_TIMEOUT_S (hivemind wants it below the window, or two requests can deadlock)
MIN_MATCHMAKING_S, REQUEST_TIMEOUT_S = 1.0, 0.8
# hivemind waits for the next chunk of a member's all-reduce stream without limit by default, so
# one silent member (stalled, gone without closing its streams) held the round until it counted as
# stuck (STUCK_ROUND_FACTOR timeouts). A sender silent this long is left out (a reducer twice as
# long); the round goes on without it (`_left_out`, `RoundResult.lost`). A part is at most 512 KiB:
# 0.4 s on the slowest link allowed, so the floor is for a busy CPU, not the wire.
NEXT_CHUNK_S = 15.0
MIN_PERIOD_S = 1.0  # the shortest slot: a hivemind round takes at least min_matchmaking_time anyway
STEP_EMA = 0.1  # weight of the newest step time in the step-time average (damps a one-off pause)
PERIOD_HYSTERESIS = 0.9  # the period halves only once the need is below 0.9x the shorter period: no flapping at a power of two
MATCH_FLOOR_S = 5.0  # a round looks for its group for at least this long (DHT round trips on a WAN), however short the period
LINK_MIN_STEPS = 4  # a round's all-reduce must span this many steps to measure the link (it is seen once per step)
StateFn = Callable[[], tuple[dict, list[torch.Tensor]]]  # -> (small metadata, tensors): what a joiner downloads


def round_bytes(numel: int, group_size: int, compression: str) -> int:
    """Bytes one peer uploads (and downloads) in one averaging round of `numel` elements.

    Butterfly all-reduce in a group of n: each peer sends (n-1)/n of its tensors to scatter and
    its averaged 1/n part to the n-1 others: 2 (n-1)/n of the tensors. One formula for the
    averager's counter and for `anchormesh bench project`."""
    n = group_size
    return int(2 * (n - 1) / n * numel * WIRE_BYTES[compression])


def sample_index(sizes: list[int], key: str, n: int = SAMPLE) -> list[torch.Tensor]:
    """Per tensor, the flat indices of a sample of n coordinates of all of them together, the same
    for every member of a group (seeded by `key`)."""
    total = sum(sizes)
    flat = torch.randperm(total, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))[:n].sort().values
    out, start = [], 0
    for size in sizes:
        out.append(flat[(flat >= start) & (flat < start + size)] - start)
        start += size
    return out


def take(tensors: list[torch.Tensor], index: list[torch.Tensor]) -> torch.Tensor:
    """The values at the sampled coordinates, on the host (claims travel and compare there)."""
    return torch.cat([t.detach().reshape(-1)[i.to(t.device)].float().cpu() for t, i in zip(tensors, index)])


def _period_need(every: int, step_s: float | None, nbytes: int, link_bps: float | None, link_share: float, measured: bool = False) -> tuple[float, str]:
    """Seconds between rounds before rounding, and what sets them (for `period_reason`);
    `measured`: the link rate comes from this peer's own rounds."""
    steps_s = every * step_s if step_s is not None else 0.0
    link_s = nbytes / (link_share * link_bps) if link_share > 0 and link_bps is not None and link_bps > 0 else 0.0
    steps = f"{every} steps x {step_s:.2f} s" if step_s is not None else "no step time yet"
    if link_s > max(steps_s, MIN_PERIOD_S):
        return link_s, f"link{' (measured)' if measured else ''} {link_bps / 1e6:.3g} MB/s, share {link_share:g}"
    if steps_s >= MIN_PERIOD_S:
        return steps_s, steps
    return MIN_PERIOD_S, f"the minimum ({steps})"


def _pow2_at_least(seconds: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(seconds, MIN_PERIOD_S)))


def slot_period(every: int, step_s: float | None, round_bytes: int, link_bps: float | None, link_share: float) -> float:
    """Seconds between a group's round slots: the longer of `every` steps of `step_s` and the time
    in which `round_bytes` take `link_share` of a `link_bps` link (no bound when either is 0 or
    unknown), rounded UP to a power of two (at least `MIN_PERIOD_S`). Why a power of two: members
    estimate the period each on its own; two estimates within 2x round to periods of which one is
    a multiple of the other, so the longer one's boundaries are boundaries of both."""
    return _pow2_at_least(_period_need(every, step_s, round_bytes, link_bps, link_share)[0])


def offer_due(steps: int, every: int, since: float, now: float, period_s: float) -> bool:
    """Whether a round is due: at least `every` steps were taken, and a multiple of `period_s`
    (a boundary of the group's slots) lies in (since, now]."""
    return steps >= every and math.floor(now / period_s) > math.floor(since / period_s)


class RoundSchedule:
    """When this peer offers a round (see the module docstring). No hivemind in here: the rule is
    tested with a fake clock. `tick` once per step, `offered` when a round was offered.

    A round is due at the first tick at which (a) at least `every` local steps were taken since
    the last offer (or the start), and (b) a multiple of `period_s` has passed since the peer
    was last held: its last offer, its last tick with `hold` (its previous round still pending,
    or it was alone) or, before its first offer, its last tick short of `every` steps. Why
    boundaries during a hold do not count: an offer right after it would be off the group's grid
    and meet nobody (a round that spanned a boundary met the members offering there, or none
    offered there).

    `period_s` is `slot_period` of the step-time average, with hysteresis: it grows as soon as
    the need exceeds it, and halves only once the need is below `PERIOD_HYSTERESIS` times the
    shorter period (a need hovering at a power of two would flip it, and log, every few steps).

    Args:
        every: local steps between rounds at least (DiLoCo H).
        round_bytes: what one round uploads (`round_bytes(numel, 2, compression)`).
        link_bps: bytes/s the uplink is measured to carry, or None (unknown): then `measured_bps`.
            Called once per tick: keep it cheap.
        link_share: fraction of the link's time the rounds may take; 0: no bound.
    """

    def __init__(self, every: int, round_bytes: int, link_bps: Callable[[], float | None] | None = None, link_share: float = 0.0) -> None:
        if every < 1:
            raise ValueError(f"every (local steps between rounds) must be >= 1, not {every}")
        if not 0.0 <= link_share <= 1.0:
            raise ValueError(f"link_share (fraction of the link's time for averaging) must be in [0, 1], not {link_share}")
        self.every, self.round_bytes, self.link_bps, self.link_share = every, round_bytes, link_bps, link_share
        self.step_s: float | None = None  # EMA of the wall time between ticks
        self.measured_bps: float | None = None  # from this peer's own rounds, used when link_bps says nothing
        self.period_s = MIN_PERIOD_S
        self.period_reason = f"{MIN_PERIOD_S:g} s: the minimum (no step time yet)"
        self._last_tick: float | None = None
        self._since_step = 0  # (a) counts steps after this one
        self._since_t = 0.0  # (b) counts boundaries after this time (both set by the first tick)
        self._first = True  # no offer yet

    def tick(self, local_step: int, now: float, hold: bool = False) -> bool:
        """Record a step that ended at `now`; whether a round is due now. `hold`: this peer cannot
        offer now (its last round is pending, or it is alone in its group)."""
        if self._last_tick is None:  # the start; the first tick follows one step
            self._since_step, self._since_t = local_step - 1, now
        else:
            dt = now - self._last_tick
            self.step_s = dt if self.step_s is None else (1 - STEP_EMA) * self.step_s + STEP_EMA * dt
        self._last_tick = now
        self._update_period()
        if hold or (self._first and local_step - self._since_step < self.every):
            self._since_t = now  # wait for a boundary after this one
        return offer_due(local_step - self._since_step, self.every, self._since_t, now, self.period_s)

    def offered(self, local_step: int, now: float) -> None:
        self._since_step, self._since_t, self._first = local_step, now, False

    def _update_period(self) -> None:
        link = self.link_bps() if self.link_bps is not None else None
        measured = not (link is not None and link > 0) and self.measured_bps is not None
        need, why = _period_need(self.every, self.step_s, self.round_bytes, self.measured_bps if measured else link, self.link_share, measured)
        period = _pow2_at_least(need)
        if period < self.period_s and need > PERIOD_HYSTERESIS * self.period_s / 2:  # not clearly shorter: keep it
            self.period_reason = f"{self.period_s:g} s: {why} (held until under {PERIOD_HYSTERESIS * self.period_s / 2:.3g} s)"
            return
        reason = f"{period:g} s: {why}"
        if period != self.period_s:
            log.info("stage-group averaging: a round every %s (was %g s)", reason, self.period_s)
        self.period_s, self.period_reason = period, reason


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


def _absmax_8bit():
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
    gathered data) and the flat ranges (start, end) of the stage's concatenated parameters whose
    results never arrived. Why the ranges: hivemind keeps this peer's own values there and says
    only "received 99.9% results" in its log; a peer that took those values for the group mean
    would move its base (int8 deltas) away from the others' for good."""

    gathered: dict
    lost: tuple[tuple[int, int], ...] = ()


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


def _averager_class():
    from hivemind.averaging import DecentralizedAverager
    from hivemind.proto import averaging_pb2

    class StageAverager(DecentralizedAverager):
        """hivemind's averager whose shared state is the live stage state (not its averaging
        buffer), and whose rounds and state are for the stage group's members only.

        Why the member gate: hivemind's averaging RPCs (join a round, send a part, download the
        state) answer anyone who can reach this peer's libp2p address, whatever the DHT's access
        tokens say; an outsider could read a round's mean or the stage's weights and optimizer
        state, or feed a round. Once the tracker has named the members (`set_members`, from each
        heartbeat), calls from any other hivemind id are refused, and this peer never sends its
        parts to a group that holds one."""

        def __init__(self, *args, state_fn: StateFn, **kwargs) -> None:
            self._state_fn = state_fn
            self._members: frozenset[str] | None = None  # None: not named yet (nothing refused)
            self._refusals: dict[str, float] = {}
            super().__init__(*args, **kwargs)

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

        async def rpc_download_state(self, _request, _context):  # hivemind's argument names (its type hints are copied below)
            if self._stranger(_context, "a state download"):
                return  # no state: the caller tries its next donor
            async for reply in super().rpc_download_state(_request, _context):
                yield reply

        def run(self) -> None:
            """The forked averaging process: torch's thread pool rebuilt first (`after_fork`)."""
            after_fork()
            super().run()

        def get_current_state(self):  # runs in this (host) process, on hivemind's background thread
            metadata, tensors = self._state_fn()
            return metadata, tensors, None

        async def _aggregate_with_group(self, group_info, *args, **kwargs) -> RoundResult:
            """hivemind's round, with the flat ranges whose results were lost handed back too."""
            self._lost: list[tuple[int, int]] = []
            gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
            return RoundResult(gathered, tuple(self._lost))

        async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
            """hivemind's method with its runner swapped for the trimmed-mean one (peer/dp/robust.py)."""
            from hivemind.averaging.averager import AveragingMode
            from hivemind.utils import get_dht_time
            from hivemind.utils.asyncio import as_aiter, azip

            from peer.dp.robust import runner_class

            group_id = group_info.group_id if group_id is None else group_id
            strangers = [str(p) for p in group_info.peer_ids if self._members is not None and str(p) not in self._members]
            if strangers:  # a group led or joined by a non-member: send it nothing
                from hivemind.averaging.partition import AllreduceException

                raise AllreduceException(f"the group includes non-members of this stage group: {', '.join(strangers)}")
            runner = runner_class()(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
            assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
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


class GroupAverager:
    """Args:
        dht: a running hivemind DHT of the run.
        params: the stage's parameters (updated in place).
        prefix: matchmaking key, e.g. "<run_id>_stage1" (no dots: hivemind forbids them); only peers with the same prefix meet.
        every: local steps between rounds (DiLoCo H).
        timeout: seconds a round may take, matchmaking included.
        state_fn: the state a joiner downloads; default: the parameters alone. Called from
            hivemind's thread: hold `lock` while changing what it reads.
        compression: "none" (fp32 parameters) or "int8" (8-bit deltas from the last group mean).
        peer_id: the run's id of this peer, carried in its claims (for logs).
        link_bps: bytes/s this peer's uplink is measured to carry (None: unknown), called once per
            step; when it says nothing, the rate this averager's own rounds achieved is used (`measured_bps`).
        link_share: fraction of the link's time averaging may take (0: no bound): rounds are at
            least `round_bytes / (link_share * link)` seconds apart.
        clock: wall-clock seconds since the epoch, the same for all members (tests pass a fake one).

    Public state: `rounds`, `failures`, `rejected`, `bytes_out`, `period_s` and `period_reason`
    (the slot length and why, e.g. "8 s: 10 steps x 0.61 s"), `step_s`, `measured_bps`.
    """

    def __init__(
        self, dht, params: list[torch.nn.Parameter], prefix: str, every: int = 10, timeout: float = 30.0, state_fn: StateFn | None = None,
        compression: str = "int8", peer_id: str = "", link_bps: Callable[[], float | None] | None = None, link_share: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from hivemind.compression import NoCompression

        if compression not in WIRE_BYTES:
            raise ValueError(f"compression must be one of {', '.join(WIRE_BYTES)}, not {compression!r}")
        self.compression = compression

        self.params, self.every, self.timeout = params, every, timeout
        self.numel = sum(p.numel() for p in params)
        self.schedule = RoundSchedule(every, round_bytes(self.numel, 2, compression), link_bps, link_share)
        self._clock = clock
        self._ticks = 0  # after_step calls so far (the unit in which a round's all-reduce is seen)
        self._allreduce_seen: tuple[int, float] | None = None  # (tick, clock) when the pending round was first seen exchanging
        self.lock = threading.Lock()  # the owner holds it while stepping; state_fn reads under it
        self._offered: list[torch.Tensor] | None = None
        self._pending: Future | None = None
        self.rounds = 0
        self.failures = 0
        self.bytes_out = 0  # estimated from tensor sizes: hivemind exposes no byte counter
        self.dense_bytes = 0  # a dense fp32 gradient all-reduce every step, over the same steps
        self._last_round_step: int | None = None  # set at the first step this averager sees (a joiner starts late)
        self._offered_at = 0
        self._offered_wall = 0.0  # when the pending round was offered (monotonic)
        self.last_error = ""
        self.rejected = 0  # rounds whose result failed the plausibility rule (see _implausible)
        self.left_out = 0  # rounds in which hivemind dropped a member's part (see _left_out)
        self.partial = 0  # rounds of which some results never came back to this peer (see RoundResult)
        self.last_lost: list[torch.Tensor] | None = None  # per parameter, where the last accepted round's results were lost
        self.last_rejection = ""
        self.peer_id = peer_id  # the run's id of this peer, carried in its claims (for logs)
        self.suspects: deque[str] = deque(maxlen=4)  # "HIVEMIND_PEER_ID: why" of members named by refused rounds, newest last
        self.excluded: dict[str, str] = {}  # hivemind peer id -> why (banned by the operator): rounds with these members are refused
        # hivemind peer ids of the stage group's members, from the tracker (None: not known yet);
        # a round with anyone else in it is refused: an outsider who found the group key
        self._members: set[str] | None = None
        self._index = sample_index([p.numel() for p in params], prefix)
        self._base = [p.detach().clone() for p in params]  # the last group mean ("int8" sends the change from it)
        for attempt in range(1, START_TRIES + 1):
            self.averager = _averager_class()(
                # host copies (hivemind puts them in shared memory for its forked process, which
                # must never touch CUDA); the base and the offered copy stay where the weights are
                [p.detach().to("cpu", copy=True) for p in params], dht, start=False, prefix=prefix, target_group_size=None, min_group_size=2,
                min_matchmaking_time=MIN_MATCHMAKING_S, request_timeout=REQUEST_TIMEOUT_S, next_chunk_timeout=NEXT_CHUNK_S, compression=_absmax_8bit() if compression == "int8" else NoCompression(),
                state_fn=state_fn or self._params_state, allow_state_sharing=False,  # nothing worth sharing before training
            )
            try:
                # hivemind forks its averaging process; a fork beside live threads (gRPC's, the DHT
                # client's) now and then leaves the child stuck before it is ready, and hivemind
                # would wait for it forever: wait a bounded time, then kill it and fork again
                self.averager.run_in_background(await_ready=True, timeout=START_TIMEOUT_S)
                break
            except TimeoutError:
                log.warning("the stage-group averaging process did not start within %.0fs (try %d of %d); starting it again", START_TIMEOUT_S, attempt, START_TRIES)
                self.averager.kill()
                self.averager.join(5)
        else:
            raise AnchormeshError(f"the stage-group averaging process did not start in {START_TRIES} tries of {START_TIMEOUT_S:.0f}s")

    def _params_state(self) -> tuple[dict, list[torch.Tensor]]:
        with self.lock:
            # metadata must not be empty: hivemind takes an empty one for "no state to send"
            return {"tensors": len(self.params)}, [p.detach().to("cpu", copy=True) for p in self.params]

    def share_state(self, priority: float) -> None:
        """Offer this peer's state to joiners; the highest priority (its step count) is asked first."""
        self.averager.state_sharing_priority = float(priority)
        self.averager.allow_state_sharing = True

    @property
    def members(self) -> set[str] | None:
        """Hivemind ids of the stage group's members as the tracker names them (None: not yet)."""
        return self._members

    @members.setter
    def members(self, value: set[str] | None) -> None:
        if value is not None and value != self._members:  # the averaging process refuses anyone else
            self.averager.set_members(frozenset(value) | {str(self.averager.peer_id)})
        self._members = value

    def load_state(self, timeout: float = 60.0, tries: int = 3, wait_s: float = 2.0) -> tuple[dict, list[torch.Tensor]] | None:
        """The state of the most-trained peer of the group, or None (nobody to ask, or it failed).
        When donors are declared but none answered, it asks again (`tries`, `wait_s` apart): a
        donor refuses non-members, and learns of a peer that just joined at its next heartbeat."""
        deadline = time.monotonic() + timeout
        for attempt in range(1, tries + 1):
            try:
                got = self.averager.load_state_from_peers(timeout=max(deadline - time.monotonic(), 1.0))
            except Exception as exc:  # a donor that vanished mid-download, a timeout
                log.warning("could not download the stage state from the group: %s: %s", type(exc).__name__, exc)
                got = None
            if got is not None or attempt == tries or time.monotonic() + wait_s >= deadline or not self._donors_declared():
                return got
            log.info("no stage-group member sent its state (try %d of %d); asking again in %.0f s", attempt, tries, wait_s)
            time.sleep(wait_s)
        return None

    def _donors_declared(self) -> bool:
        """Whether another member has declared its state downloadable (hivemind's DHT record)."""
        try:
            found = self.averager.dht.get(f"{self.averager.prefix}.all_averagers", latest=True)
        except Exception:  # the DHT is shutting down
            return False
        own = self.averager.peer_id.to_bytes()
        return found is not None and isinstance(found.value, dict) and any(k != own for k in found.value)

    @property
    def period_s(self) -> float:
        return self.schedule.period_s

    @property
    def period_reason(self) -> str:
        return self.schedule.period_reason

    @property
    def step_s(self) -> float | None:
        return self.schedule.step_s

    @property
    def measured_bps(self) -> float | None:
        return self.schedule.measured_bps

    def after_step(self, local_step: int, alone: bool = False) -> None:
        """Call after every optimizer step; never blocks. Offers a round when `RoundSchedule` says
        one is due and none is pending. `alone`: the tracker lists no other live member of this
        stage group, so no round is offered (matchmaking for a group that cannot form costs the
        averaging process CPU for nothing, about 0.4 core per peer measured)."""
        from hivemind.averaging.control import AveragingStage
        from hivemind.utils import get_dht_time

        now = self._clock()
        self._ticks += 1
        if self._last_round_step is None:
            self._last_round_step = local_step - 1
        if self._pending is not None and self._pending.done():
            self._finish()
        elif self._pending is not None and time.monotonic() - self._offered_wall > self.stuck_after_s():
            # hivemind's step timeout bounds finding a group only, not the all-reduce after it: a
            # round was seen pending for minutes (the demo's stage 0), and none was offered after it
            self._pending.cancel()
            self._pending = None
            self.failures += 1
            self.last_error = f"round pending for over {self.stuck_after_s():.0f}s: cancelled"
            log.warning("stage-group averaging: %s", self.last_error)
        elif self._pending is not None:
            if self._pending.stage != AveragingStage.RUNNING_ALLREDUCE:
                self._allreduce_seen = None  # (still, or again after a failed try) looking for a group
            elif self._allreduce_seen is None:
                self._allreduce_seen = (self._ticks, now)
        due = self.schedule.tick(local_step, now, hold=alone or self._pending is not None)
        if self._pending is None and due:
            self._offered = [p.detach().clone() for p in self.params]
            self._offered_at = local_step
            self._offered_wall = time.monotonic()
            self._allreduce_seen = None
            with torch.no_grad(), self.averager.get_tensors() as tensors:
                for t, p, base in zip(tensors, self._offered, self._base):
                    t.copy_(p - base if self.compression == "int8" else p)
                sample = take(tensors, self._index)
            claim = {"peer": self.peer_id, "sample": sample.numpy().tobytes()}
            until = math.floor(now / self.period_s) * self.period_s + self.match_window_s() - now  # the group forms then
            self._pending = self.averager.step(gather=claim, scheduled_time=get_dht_time() + until, wait=False, timeout=self.match_timeout_s())
            self.schedule.offered(local_step, now)

    def match_window_s(self) -> float:
        """How long after the slot boundary the group forms: `MIN_MATCHMAKING_S` plus a step (at
        most half the matchmaking timeout). Why: members offer at their first step after the
        boundary, so the last arrives about a step after it; hivemind's leader forms the group when
        its window ends, with whoever joined by then (a leader still alone opens a new window, so a
        pair meets anyway, but a third member that comes later is left out)."""
        return min(MIN_MATCHMAKING_S + (self.schedule.step_s or 0.0), self.match_timeout_s() / 2)

    def match_timeout_s(self) -> float:
        """How long a round looks for its group: half a period (at least `MATCH_FLOOR_S`, at most
        `timeout`). Why: members offer within about a step of the same boundary, so a round that
        has found nobody by then waits for nobody, and polling on would cost CPU and could run into
        the next boundary (a member whose period is half the group's offers alone at every other one)."""
        return min(self.timeout, max(self.schedule.period_s / 2, MATCH_FLOOR_S))

    def stuck_after_s(self) -> float:
        """How long a round may stay pending: `STUCK_ROUND_FACTOR` timeouts plus the time its
        bytes take on a 10 Mbit/s link (a big stage's fp32 round legitimately takes minutes)."""
        return STUCK_ROUND_FACTOR * self.timeout + round_bytes(self.numel, 2, self.compression) / SLOWEST_LINK_BPS

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        try:
            got = pending.result()
        except Exception as exc:  # hivemind reports no-group / timeouts as exceptions
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.info("stage-group averaging found no group this round (%s)", self.last_error)
            return
        group, lost = (got.gathered, got.lost) if isinstance(got, RoundResult) else (got, ())
        if not group:
            self.failures += 1
            return
        n = len(group)
        self.bytes_out += round_bytes(self.numel, n, self.compression)
        self._measure_link(round_bytes(self.numel, n, self.compression))
        self.dense_bytes += round_bytes(self.numel, n, "none") * max(self._offered_at - self._last_round_step, 1)
        self._last_round_step = self._offered_at
        masks = lost_masks(lost, [p.numel() for p in self.params]) if lost else None
        with torch.no_grad(), self.averager.get_tensors() as tensors:
            means = [(base + m.to(base.device, base.dtype)) if self.compression == "int8" else m.to(base.device, base.dtype, copy=True) for m, base in zip(tensors, self._base)]
            result = take(tensors, self._index)
        # where results were lost the "mean" is this peer's own offer: the claims cannot be checked there
        kept = take(masks, self._index) == 0 if masks else None
        why, named = self._attribute(group, result, kept)
        why = why or self._implausible(means)
        if why:  # keep the local weights and the old base: as if the round had not happened
            self.rejected += 1
            self.last_rejection = why
            self.suspects.extend(named)
            log.warning("stage-group averaging result rejected (%d so far): %s", self.rejected, why)
            return
        with torch.no_grad():
            for i, (p, offered, mean, base) in enumerate(zip(self.params, self._offered, means, self._base)):
                p.add_(mean.to(p.dtype) - offered)  # zero where results were lost: the own offer came back
                if masks is None:
                    base.copy_(mean)
                else:  # lost coordinates keep the old base: their drift is offered again next round
                    base.copy_(torch.where(masks[i].view_as(base).to(base.device), base, mean))
        self.rounds += 1
        self.last_lost = [m.view_as(p) for m, p in zip(masks, self.params)] if masks else None
        if masks:
            self.partial += 1
            n = sum(int(m.sum()) for m in masks)
            log.warning("stage-group averaging: %d of %d values (%.2f%%) got no result back this round (a member's stream failed); they keep this peer's values", n, self.numel, 100 * n / max(self.numel, 1))

    def _measure_link(self, nbytes: int) -> None:
        """The rate of the round that just ended: its bytes over its all-reduce time (matchmaking
        excluded), kept only when the all-reduce was seen over at least `LINK_MIN_STEPS` steps: it
        is seen once per step, so shorter ones are mostly measurement error (and use little link)."""
        seen, self._allreduce_seen = self._allreduce_seen, None
        if seen is not None and self._ticks - seen[0] >= LINK_MIN_STEPS and self._clock() > seen[1]:
            self.schedule.measured_bps = nbytes / (self._clock() - seen[1])

    def _attribute(self, group: dict, result: torch.Tensor, kept: torch.Tensor | None = None) -> tuple[str, list[str]]:
        """Check the round against the members' claims; (why it is refused or "", the members
        named as "peer: why"). `kept`: the sampled coordinates whose results arrived (all when
        None); rule (1) is checked on those only.

        Rules, at the sampled coordinates: (1) the mean must equal the mean of the claims, within
        `CLAIM_TOLERANCE` of the largest claimed update: otherwise some member sent other values
        than it declared, and nobody can be named. (2) a claimed update holding NaN/Inf, (3) one
        larger than `MAX_CORRECTION` times the median update of the others, or (4) one whose
        cosine with the others' mean update is below `FLIP_COSINE` names that member. Why these:
        honest replicas start from the same mean and train on the same distribution for the same
        number of steps, so their updates have similar sizes and point the same way; scaled,
        NaN and sign-flipped updates do not. Rules (3) and (4) need at least three members (two
        others to compare with): in a pair, an honest member whose base is older looks just as
        outsized, so a pair relies on (1), (2) and `_implausible`. A member never names itself.
        A member banned by the operator (`excluded`, from the heartbeat's `banned_dht`) makes
        every round that includes it refused: hivemind's matchmaking cannot leave it out, so the
        honest members train on without averaging with it. Nobody is excluded on a peer's own
        say-so: a false alarm would stop a group's averaging for good."""
        out = [str(h) for h in group if str(h) in self.excluded]
        if out:  # hivemind cannot keep a member out of matchmaking; its rounds are refused instead
            return "the group includes excluded member(s) " + ", ".join(f"{h} ({self.excluded[h]})" for h in out), []
        me = str(self.averager.peer_id)
        strangers = [str(h) for h in group if self.members is not None and str(h) not in self.members and str(h) != me]
        if strangers:  # a member that joined since the last heartbeat is refused once, then known
            return "the group includes peer(s) that are not members of this stage group: " + ", ".join(strangers), [f"{h}: not a member of the run" for h in strangers]
        claims: dict[str, torch.Tensor] = {}
        for hid, c in group.items():
            # members are named by their hivemind peer id (libp2p authenticates it), not by the id
            # they claim: the tracker maps it to the run's peer id (bootstrap/tracker.py)
            name = str(hid)
            raw = c.get("sample") if isinstance(c, dict) else None
            if not isinstance(raw, bytes) or len(raw) != 4 * result.numel():
                return f"member {name} sent no valid claim", [f"{name}: no valid claim of what it sent"]
            claims[name] = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        base = take(self._base, self._index)
        updates = {k: (v if self.compression == "int8" else v - base) for k, v in claims.items()}
        floor = 1e-5 * float(base.norm()) + 1e-12
        for name, u in updates.items():
            if not torch.isfinite(u).all() and name != me:
                return f"member {name} sent NaN or Inf", [f"{name}: sent NaN or Inf"]
        if not all(torch.isfinite(u).all() for u in updates.values()):
            return "a member sent NaN or Inf", []
        biggest = max(float(u.norm()) for u in updates.values())
        if kept is not None:  # results lost on the way back: compare where they arrived
            result, claims = result[kept], {k: v[kept] for k, v in claims.items()}
        off = float((result - trimmed_mean(torch.stack(list(claims.values())))).norm())  # what the robust reducers compute from the claims
        if off > CLAIM_TOLERANCE * biggest + floor:
            dropped = self._left_out(claims, result, CLAIM_TOLERANCE * biggest + floor)
            if dropped is None:
                return f"the mean is {off:.3g} away from the mean of what the members declared (largest update {biggest:.3g}): a member sent other values than it claimed", []
            # hivemind dropped this sender (its stream failed): the result is the others' mean; every
            # claim still counts below (a dropped member that flipped its update is still named)
            log.info("stage-group averaging: hivemind left member %s's part out of the round (its sending failed)", dropped)
            self.left_out += 1
        named = []
        for name, u in updates.items():
            # size and direction need at least two others to compare with: in a pair, an honest
            # member whose base is older (it missed a round, or just joined) looks "outsized" too
            if name == me or len(updates) < 3:
                continue
            others = [v for k, v in updates.items() if k != name]
            ref = float(torch.stack([v.norm() for v in others]).median())
            if float(u.norm()) > MAX_CORRECTION * ref + floor:
                named.append(f"{name}: its update is {float(u.norm()) / max(ref, 1e-30):.1f}x the others' (limit {MAX_CORRECTION:g}x)")
                continue
            rest = torch.stack(others).mean(0)
            cos = float(u @ rest / (u.norm() * rest.norm() + 1e-30))
            if cos < FLIP_COSINE:
                named.append(f"{name}: its update points against the rest of the group (cosine {cos:.2f})")
        if named:
            return "; ".join(named), named
        return "", []

    def _left_out(self, claims: dict[str, torch.Tensor], result: torch.Tensor, tolerance: float) -> str | None:
        """The one member (not this peer) whose part hivemind left out of the round, if the result
        is the trimmed mean of everyone else's claims; else None. Why: hivemind's all-reduce drops
        a sender whose stream fails (a busy or leaving peer) and reduces the others' parts, so an
        honest round can miss a member; refusing it as a lie would name a fault nobody made."""
        me = str(self.averager.peer_id)
        if len(claims) < 3:  # in a pair, "the other's values alone" would pass any one-sided result
            return None
        for name in claims:
            rest = [v for k, v in claims.items() if k != name]
            if name != me and float((result - trimmed_mean(torch.stack(rest))).norm()) <= tolerance:
                return name
        return None

    def _implausible(self, means: list[torch.Tensor]) -> str:
        """Why the group's mean cannot be right, or "". The rule: every value finite, and the
        correction it asks for (mean - what this peer offered) at most `MAX_CORRECTION` times this
        peer's own drift since the last mean (plus a small floor). Why: honest replicas start a
        round from the same mean and drift by similar amounts in `every` local steps, so the
        mean of n of them lies within about that drift; a NaN or scaled contribution (a broken or
        hostile peer) lands far outside it. The whole round is dropped because hivemind's
        all-reduce hands back only the mean: the sender of a bad part cannot be told apart here."""
        if not all(torch.isfinite(m).all() for m in means):
            return "the group mean holds NaN or Inf"
        correction = torch.sqrt(sum(((m - o) ** 2).sum() for m, o in zip(means, self._offered)))
        drift = torch.sqrt(sum(((o - b) ** 2).sum() for o, b in zip(self._offered, self._base)))
        scale = torch.sqrt(sum((b**2).sum() for b in self._base))
        limit = MAX_CORRECTION * drift + 1e-3 * scale
        if correction > limit:
            return f"it would move the weights by {float(correction):.3g}, more than {MAX_CORRECTION}x this peer's own drift since the last mean ({float(drift):.3g}) plus 0.1% of their norm"
        return ""

    def rebase(self) -> None:
        """After the parameters were replaced wholesale (a downloaded state): they are the new
        group mean, so the next delta counts from them. Call under `lock`."""
        self._base = [p.detach().clone() for p in self.params]

    def shutdown(self) -> None:
        self.averager.shutdown()
