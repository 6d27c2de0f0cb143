"""Whether a stage state a donor hands a joiner is close to what the rest of its group holds.

Why: the bounds on a downloaded state (peer/daemon/state_sync.py `check_state`) refuse what no
training reaches, but a hostile member can serve its mates' weights negated (cosine -1 to theirs)
or noise just under the norm bound, and the joiner would train on from there and average it into
the group. So before a donor's state is taken, its weights are compared, tensor by tensor, with
sketches of the weights other members of the group serve (`GetShard`, what = SKETCH: 4,096
values a tensor, about 2 % from the full distances, hashed with a seed this peer draws for the
judgement; peer/store/sketch.py), fetched once per witness and only when a donor is judged:

- taken when at least one witness that answered finds it close (within GROUP_REL of its norm
  per tensor: members of one group differ by a few steps of drift, not by their norm) and the
  donor with the witnesses close to it outnumber those that find it far;
- refused when those that find it far outnumber the donor and the witnesses close to it: the
  donor is named and the next one is tried (a refused donor's state still witnesses the next);
- on a tie (one witness against), or with no witness (a single donor, a replica restored after
  the whole group died), the single-donor policy: taken only as far from this peer's own
  weights before the download (its initial, pretrained or checkpointed weights, which every
  member started from) as AdamW can move a weight in the steps between the two: each step moves
  a value at most lr x |m| / sqrt(v), and |m| <= c sqrt(v) (state_sync.py `check_state`), so
  REACH_MARGIN x lr x max(1, c) per step (the margin: averaging, rounding, weight decay).

What stays open: a state within those distances (a subtle poison, a bias) passes; donors that
collude and outnumber the honest witnesses vouch for each other; a lone donor's reach grows with
lr x steps, so at a pretraining lr the single-donor policy refuses the negated or noised state of
a young run but, after enough steps, admits anything the state's norm bounds admit.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

import torch

from peer.store.sketch import SIZE, sketch_length, sketches
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.peer")
GROUP_REL = 1.0  # per tensor: distance to a witness's weights at most this x the witness's norm (a negation is 2x) ...
ABS_RMS = (
    0.1  # ... plus this x the root-mean-square of this peer's own stage weights per value (a zero-initialised bias)
)
REACH_MARGIN = (
    2.0  # the single-donor policy's reach per step: this x lr x max(1, c) per value (c: the AdamW moment bound)
)
MAX_WITNESSES = 3  # donors asked for their weights to judge one donor's state

Weights = Callable[
    [pb.PeerInfo, int, int], "list[torch.Tensor] | None"
]  # (donor, seed, size) -> its weights' sketches in named_parameters order, None: no answer


def far(
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    ref: Sequence[torch.Tensor],
    rel: float,
    per_value: float,
    what: str,
    sizes: Sequence[int] | None = None,
) -> str:
    """Why `params` is not close to `ref` (the first tensor more than `rel` x its norm, plus
    `per_value` x the root of its size, away), or "". Sketches (peer/store/sketch.py) compare as
    the tensors do, given the tensors' `sizes`."""
    for i, (name, p, r) in enumerate(zip(names, params, ref)):
        if tuple(p.shape) != tuple(r.shape):
            return f"weight {name}: shape {tuple(p.shape)}, not that of {what} {tuple(r.shape)}"
        p32, r32 = p.detach().float(), r.detach().float()
        n = sizes[i] if sizes is not None else p.numel()
        d, bound = float((p32 - r32).norm()), rel * float(r32.norm()) + per_value * n**0.5
        if not d <= bound:
            cos = float(torch.nn.functional.cosine_similarity(p32.flatten(), r32.flatten(), dim=0))
            return f"weight {name}: {d:.3g} away from {what} (at most {bound:.3g}; cosine {cos:.2f})"
    return ""


class Witnesses:
    """The judge of one joiner's downloads: its own weights before any download, the donors the
    tracker listed, and their weights once fetched (kept: a donor is a witness for the next)."""

    def __init__(
        self,
        names: Sequence[str],
        own: Sequence[torch.Tensor],
        donors: Sequence[pb.PeerInfo],
        weights: Weights | None,
        reach: float,
    ) -> None:
        self.names, self.own = list(names), [t.detach().to("cpu", copy=True) for t in own]
        total = sum(t.numel() for t in self.own)
        self.rms = (sum(float(t.float().pow(2).sum()) for t in self.own) / max(total, 1)) ** 0.5
        self.donors, self.weights, self.reach = list(donors), weights, reach  # reach: what one step may move a value
        self.seed, self.size = secrets.randbits(63), SIZE  # a member cannot shape weights for a seed it never saw
        self.sizes = [t.numel() for t in self.own]
        self.seen: dict[str, list[torch.Tensor] | None] = {}  # each donor's sketches

    def _of(self, donor: pb.PeerInfo) -> list[torch.Tensor] | None:
        if donor.peer_id not in self.seen:
            got = None
            try:
                got = self.weights(donor, self.seed, self.size) if self.weights is not None else None
            except Exception as exc:  # a witness that does not answer is not counted  # noqa: BLE001
                log.info("stage mate %s gave no weights to compare with: %s", donor.peer_id, exc)
            want = [sketch_length(n, self.size) for n in self.sizes]
            if got is not None and [t.numel() for t in got] != want:
                log.info("stage mate %s sent sketches of the wrong sizes: not counted", donor.peer_id)
                got = None
            self.seen[donor.peer_id] = got
        return self.seen[donor.peer_id]

    def judge(self, donor: pb.PeerInfo | None, params: Sequence[torch.Tensor], steps: int) -> str:
        """Why the state `donor` served (its weights `params`, at most `steps` past this peer's own)
        is not taken, or ""."""
        agree, disagree = [], []
        mine = None  # the state's sketches, with this judgement's seed
        for w in [d for d in self.donors if donor is None or d.peer_id != donor.peer_id][:MAX_WITNESSES]:
            ref = self._of(w)
            if ref is None:
                continue
            mine = mine if mine is not None else sketches(params, self.seed, self.size)
            why = far(self.names, mine, ref, GROUP_REL, ABS_RMS * self.rms, f"stage mate {w.peer_id}'s", self.sizes)
            (disagree if why else agree).append(why or w.peer_id)
        if donor is not None and donor.peer_id not in self.seen:
            self.seen[donor.peer_id] = mine if mine is not None else sketches(params, self.seed, self.size)
        if agree and 1 + len(agree) > len(disagree):  # the donor and the witnesses close to it outnumber the others
            return ""
        if len(disagree) > 1 + len(agree):
            return f"far from what {len(disagree)} of {len(agree) + len(disagree)} stage mates hold ({disagree[0]})"
        alone = far(self.names, params, self.own, 0.0, ABS_RMS * self.rms + self.reach * steps, "this peer's own")
        if not alone:
            return ""
        vouch = (
            f"{len(agree)} stage mate(s) vouch for it, {len(disagree)} against"
            if agree or disagree
            else "no stage mate to compare with"
        )
        return f"{vouch}, and it is far from this peer's own weights: {alone}"
