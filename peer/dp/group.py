"""Parameter averaging inside one stage group over the network (hivemind averaging).

A peer offers its stage parameters to hivemind's DecentralizedAverager (matchmaking over the
run's DHT, keyed by run and stage) about every `every` local steps. The round runs in the
background while the peer keeps training; when it finishes, the peer adds (group mean - what it
offered) to its current weights, so the local steps taken meanwhile are kept (DiLoCo's outer step
with lr 1, applied late). No peer waits for the slowest: a peer alone in its stage, or a round
that finds no group in time, just trains on.

When a round is offered: at wall-clock slot boundaries the group shares, so that members arrive
within about a step of each other (peer/dp/schedule.py, `RoundSchedule`); the group forms a step
after the boundary (`match_window_s`), and a round that has found nobody after half a period
gives up (`match_timeout_s`) instead of polling on.

On the wire (`compression`): "none" averages the fp32 parameters themselves (the uncompressed
baseline); "int8" averages the *change since the last group mean* (the DiLoCo outer delta),
8-bit with hivemind's uniform quantizer. Why deltas: a few steps of change are small and
centred, so 8 bits lose little, while 8-bit parameters would lose most of their mantissa.

Each round also carries every member's signed *claim*: its id and a commitment to every value it
sends (a Merkle root). The reduction is a trimmed mean in which every member weighs 1
(peer/dp/robust.py); after it, each member has the others reveal their committed values at
coordinates it drew privately (peer/dp/audit.py), and the result is checked against them before
it is taken (peer/dp/claims.py); members whose updates are NaN, outsized, sign-flipped or far
from this peer's own, or who cannot prove what they sent, are named and the round refused; a
member whose updates lean one way over many rounds is named (peer/dp/steering.py).

A joiner's state download does not go through hivemind (its `load_state_from_peers` takes the
first donor that answers, with no size bound): it goes over the Stage service
(peer/daemon/replicas.py), and the averager refuses hivemind's state downloads.

This module is the driver (`GroupAverager`): it offers rounds, applies or refuses their results
and keeps the counters the status shows; hivemind's averager itself is peer/dp/hivemind_averager.py,
and starting its process (settings, forks that hang) peer/dp/group_process.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from peer.dp.claims import attribute, implausible, lean_of_round, split_index, take
from peer.dp.group_process import MIN_MATCHMAKING_S, start_averager
from peer.dp.hivemind_averager import RoundResult, lost_masks
from peer.dp.schedule import MIN_PERIOD_S, WIRE_BYTES, RoundSchedule, round_bytes
from peer.dp.signed_claims import ClaimSigner
from peer.dp.steering import BiasTracker

log = logging.getLogger(__name__)


STUCK_ROUND_FACTOR = 3.0  # a round pending this many times its timeout (plus its transfer time, below) is cancelled
SLOWEST_LINK_BPS = 1.25e6  # 10 Mbit/s: the slowest link a round's bytes are allowed to take before it counts as stuck
MATCH_FLOOR_S = (
    5.0  # a round looks for its group for at least this long (DHT round trips on a WAN), however short the period
)
LINK_MIN_STEPS = 4  # a round's all-reduce must span this many steps to measure the link (it is seen once per step)


class GroupAverager:
    """Args:
        dht: a running hivemind DHT of the run.
        params: the stage's parameters (updated in place), or the same on the meta device: then
            `bind` gives the live ones once the stage is built (see `bind`).
        prefix: matchmaking key, e.g. "<run_id>_stage1" (no dots: hivemind forbids them); only peers with the same prefix meet.
        every: local steps between rounds (DiLoCo H).
        timeout: seconds a round may take, matchmaking included.
        compression: "none" (fp32 parameters) or "int8" (8-bit deltas from the last group mean).
        peer_id: the run's id of this peer, carried in its claims (for logs).
        link_bps: bytes/s this peer's uplink is measured to carry (None: unknown), called once per
            step; when it says nothing, the rate this averager's own rounds achieved is used (`measured_bps`).
        link_share: fraction of the link's time averaging may take (0: no bound): rounds are at
            least `round_bytes / (link_share * link)` seconds apart.
        clock: wall-clock seconds since the epoch, the same for all members (tests pass a fake one).
        min_period_s: the shortest time between rounds (`dp.min_period_s`; see RoundSchedule).
        signer: this member's identity and certificate (peer/dp/signed_claims.py): its claims are
            signed (in the averaging process, where the root is made), and a round whose claims
            are not all members' untouched ones is refused. None: claims go unsigned and
            unchecked (tests of the averaging alone).
        on_stuck: called (from a watchdog thread) if starting the averaging process never comes
            back from its fork; with it, a fork that holds the GIL past that ends the process
            (status 1). None: the stacks are written and the process stays stuck (tests).

    Public state: `rounds`, `failures`, `rejected`, `bytes_out`, `period_s` and `period_reason`
    (the slot length and why, e.g. "8 s: 10 steps x 0.61 s"), `step_s`, `measured_bps`.
    """

    def __init__(
        self,
        dht,
        params: list[torch.nn.Parameter],
        prefix: str,
        every: int = 10,
        timeout: float = 30.0,
        compression: str = "int8",
        peer_id: str = "",
        link_bps: Callable[[], float | None] | None = None,
        link_share: float = 0.0,
        clock: Callable[[], float] = time.time,
        signer: ClaimSigner | None = None,
        min_period_s: float = MIN_PERIOD_S,
        on_stuck: Callable[[], None] | None = None,
    ) -> None:
        if compression not in WIRE_BYTES:
            raise ValueError(f"compression must be one of {', '.join(WIRE_BYTES)}, not {compression!r}")
        self.compression = compression

        self.params: list[torch.nn.Parameter] = []  # `bind`
        self.every, self.timeout = every, timeout
        self._shapes = [tuple(p.shape) for p in params]
        self.numel = sum(p.numel() for p in params)
        self.schedule = RoundSchedule(
            every, round_bytes(self.numel, 2, compression), link_bps, link_share, min_period_s
        )
        self._clock = clock
        self._ticks = 0  # after_step calls so far (the unit in which a round's all-reduce is seen)
        self._allreduce_seen: tuple[int, float] | None = (
            None  # (tick, clock) when the pending round was first seen exchanging
        )
        self.lock = (
            threading.Lock()
        )  # the owner holds it while stepping; a copy of the state for a joiner or a checkpoint is taken under it
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
        self.rejected = 0  # rounds whose result failed the plausibility rule (see claims.implausible)
        self.left_out = 0  # rounds in which hivemind dropped a member's part (see claims.left_out)
        self.partial = 0  # rounds of which some results never came back to this peer (see RoundResult)
        self.last_lost: list[torch.Tensor] | None = (
            None  # per parameter, where the last accepted round's results were lost
        )
        self.last_rejection = ""
        self.peer_id = peer_id  # the run's id of this peer, carried in its claims (for logs)
        self.signer = signer
        self._offered_clock = 0.0  # wall clock of the pending offer: a claim made far from it is a replay
        self.suspects: deque[str] = deque(
            maxlen=4
        )  # "HIVEMIND_PEER_ID: why" of members named by refused rounds, newest last
        self.excluded: dict[
            str, str
        ] = {}  # hivemind peer id -> why (banned by the operator): rounds with these members are refused
        # hivemind peer ids of the stage group's members, from the tracker (None: not known yet);
        # a round with anyone else in it is refused: an outsider who found the group key
        self._members: set[str] | None = None
        self._base: list[torch.Tensor] = []  # the last group mean ("int8" sends the change from it): `bind`
        self.bias = BiasTracker(
            list(params)
        )  # each member's lean over rounds (host memory: four copies of the stage, from a round of three members)
        self.leaning = 0  # members named by `bias` (also in `suspects`)
        self.averager = start_averager(params, dht, prefix, compression, signer, on_stuck)
        if not any(p.is_meta for p in params):
            self.bind(params)

    def bind(self, params: list[torch.nn.Parameter]) -> None:
        """The stage's live parameters, for an averager made from their shapes alone. Why: hivemind
        forks its averaging process, and the child keeps a copy of every page the parent writes
        after the fork: forked after the stage was built, the weights and the heap of loading
        them. On SmolLM2 (2 x 2 swarm) a peer with its children peaked at 5.0-6.2 GB Pss forked
        after, 4.4-5.8 GB forked before."""
        if [tuple(p.shape) for p in params] != self._shapes:
            raise ValueError(
                f"the stage's parameters {[tuple(p.shape) for p in params][:4]}... differ from the shapes this averager was made for {self._shapes[:4]}..."
            )
        self.params = params
        self._base = [p.detach().clone() for p in params]

    @property
    def members(self) -> set[str] | None:
        """Hivemind ids of the stage group's members as the tracker names them (None: not yet)."""
        return self._members

    @members.setter
    def members(self, value: set[str] | None) -> None:
        if value is not None and value != self._members:  # the averaging process refuses anyone else
            self.averager.set_members(frozenset(value) | {str(self.averager.peer_id)})
        self._members = value

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
            # the averaging process adds the commitment to what it sends (and signs): peer/dp/audit.py
            claim = {"peer": self.peer_id, "time": now}
            self._offered_clock = now
            until = (
                math.floor(now / self.period_s) * self.period_s + self.match_window_s() - now
            )  # the group forms then
            self._pending = self.averager.step(
                gather=claim, scheduled_time=get_dht_time() + until, wait=False, timeout=self.match_timeout_s()
            )
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
        group, lost, audit = (got.gathered, got.lost, got.audit) if isinstance(got, RoundResult) else (got, (), None)
        if not group:
            self.failures += 1
            return
        n = len(group)
        self.bytes_out += round_bytes(self.numel, n, self.compression)
        self._measure_link(round_bytes(self.numel, n, self.compression))
        self.dense_bytes += round_bytes(self.numel, n, "none") * max(self._offered_at - self._last_round_step, 1)
        self._last_round_step = self._offered_at
        sizes = [p.numel() for p in self.params]
        masks = lost_masks(lost, sizes) if lost else None
        index = split_index(sizes, audit.coordinates() if audit is not None else torch.zeros(0, dtype=torch.int64))
        with torch.no_grad(), self.averager.get_tensors() as tensors:
            means = [
                (base + m.to(base.device, base.dtype))
                if self.compression == "int8"
                else m.to(base.device, base.dtype, copy=True)
                for m, base in zip(tensors, self._base)
            ]
            result = take(tensors, index)
        # where results were lost the "mean" is this peer's own offer: the claims cannot be checked there
        kept = take(masks, index) == 0 if masks else None
        # claims a leader altered (or a non-member made) are refused before they are believed
        why = (
            self.signer.check_group(
                group, self.averager.prefix, self._offered_clock, self.match_timeout_s() + self.timeout
            )
            if self.signer
            else ""
        )
        named: list[str] = []
        if not why and audit is None:
            why = "the round was not audited"
        if not why:
            why, named = self._attribute(group, audit, result, index, kept)
            leaning = lean_of_round(self.bias, audit, self._base, index, self.compression, str(self.averager.peer_id))
            self.leaning += len(leaning)
            self.suspects.extend(leaning)
        why = why or implausible(means, self._offered, self._base)
        if why:  # keep the local weights and the old base: as if the round had not happened
            self.rejected += 1
            self.last_rejection = why
            self.suspects.extend(named)
            log.warning("stage-group averaging result rejected (%d so far): %s", self.rejected, why)
            return
        self.bias.add([m - b for m, b in zip(means, self._base)], [o - b for o, b in zip(self._offered, self._base)])
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
            log.warning(
                "stage-group averaging: %d of %d values (%.2f%%) got no result back this round (a member's stream failed); they keep this peer's values",
                n,
                self.numel,
                100 * n / max(self.numel, 1),
            )

    def _measure_link(self, nbytes: int) -> None:
        """The rate of the round that just ended: its bytes over its all-reduce time (matchmaking
        excluded), kept only when the all-reduce was seen over at least `LINK_MIN_STEPS` steps: it
        is seen once per step, so shorter ones are mostly measurement error (and use little link)."""
        seen, self._allreduce_seen = self._allreduce_seen, None
        if seen is not None and self._ticks - seen[0] >= LINK_MIN_STEPS and self._clock() > seen[1]:
            self.schedule.measured_bps = nbytes / (self._clock() - seen[1])

    def _attribute(
        self, group: dict, audit, result: torch.Tensor, index: list[torch.Tensor], kept: torch.Tensor | None = None
    ) -> tuple[str, list[str]]:
        """Check the round against the values the members revealed (`claims.attribute`, which
        says the rules); (why it is refused or "", the members named as "peer: why"). Counts a
        member hivemind left out of the round."""
        why, named, dropped = attribute(
            group,
            audit.tensors(),
            audit.failed,
            result,
            kept,
            me=str(self.averager.peer_id),
            members=self.members,
            excluded=self.excluded,
            base=self._base,
            index=index,
            compression=self.compression,
        )
        if dropped is not None:
            log.info(
                "stage-group averaging: hivemind left member %s's part out of the round (its sending failed)", dropped
            )
            self.left_out += 1
        return why, named

    def rebase(self) -> None:
        """After the parameters were replaced wholesale (a downloaded state): they are the new
        group mean, so the next delta counts from them. Call under `lock`."""
        self._base = [p.detach().clone() for p in self.params]

    def shutdown(self) -> None:
        self.averager.shutdown()
