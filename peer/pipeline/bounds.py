"""How large an inbound activation or gradient may be: against its link's running RMS, and a cap.

Why: values that are finite but huge (3e38 fits in bf16) pass the wire checks, make the
receiving stage's gradients non-finite, and, before the step dropped such gradients, stopped the
peer for good. A message is refused (WireError naming its RMS and the bound) when
- any value it carries is over its channel's cap, from any sender at any time: activations
  (`forward`, `anchor_forward`) `activation_cap` (security.max_activation_value), everything else
  `cap` (security.max_link_value); or
- its RMS is over `factor` (security.link_rms_factor) times the running RMS of its link: the
  sender's own messages on that channel once WARMUP of them were accepted, else the channel's
  messages from every sender (a new sender is held to what its peers send), else nothing yet.
Each refusal is counted against its sender (`refused`). Only accepted messages move the running
RMS, and slowly (EMA). Why RECOVER: an honest link's level can jump past `factor` and stay there
(gradients grew 21x within a few steps early in a swarm test's run; a peer restarted from its
checkpoint sent one micro-batch's gradient 140x over its old level while its others passed);
refusing it for good would stop the link (the sender retries that micro-batch for ever), so
after RECOVER refusals among the sender's last WINDOW messages on the channel its new level is
taken. Counted over a window, not in a row: the quiet messages between the retries of one loud
micro-batch must not restart the count. A sender that keeps sending loud messages so gets them
in after RECOVER refusals, all counted, never past the cap: the relative bound stops one-off
spikes, the cap and the dropped step stop wedging. Why activations have a cap of their own, far
above the gradients': a stage's output feeds RMSNorms only, so nothing in the loss holds its scale,
and honest hidden states can grow for thousands of steps (a tiny model's reached 7.5e5 after 300
steps of 1-bit gradients through a fixed rotation); a cap they can reach would refuse a micro-batch for ever and stop the
run. The activation cap only has to keep the receiver's arithmetic finite: an RMSNorm squares
and sums a row in float32, finite for values below about 1e17 at hidden sizes to 1e5.

The RMS and peak come from what the checks already hold on the host: a decoded tensor (mask and
low-rank codecs), or, for the transform codec, its dense rows and per-row gains
(transform_wire.magnitude) without decoding.
"""

from __future__ import annotations

import collections
import threading

import torch

from peer.errors import WireError

WARMUP = 8  # accepted messages before a running RMS bounds anything
RECOVER = 8  # messages of one sender refused for their RMS within WINDOW, after which its level is taken as the new one
WINDOW = 4 * RECOVER  # a sender's latest messages on a channel that RECOVER counts over
EMA = 0.1  # weight of a new message in the running RMS
SENDERS_KEPT = 16  # senders whose newest refusal `senders` can name
ACTIVATION_CHANNELS = frozenset({"forward", "anchor_forward"})  # held to the activation cap


def scale_of(t: torch.Tensor) -> tuple[float, float]:
    """(RMS, largest magnitude) of a decoded tensor."""
    if not t.numel():
        return 0.0, 0.0
    t = t.detach().float()
    return float(t.pow(2).mean().sqrt()), float(t.abs().max())


class LinkBounds:
    """Running RMS per (channel, sender) and per channel; the checks of the transport's threads.

    Args:
        factor: how many times its link's running RMS a message's RMS may be.
        cap: the largest magnitude a gradient (or any value not an activation) may have.
        activation_cap: the largest magnitude an activation may have.
    """

    def __init__(self, factor: float = 64.0, cap: float = 1e6, activation_cap: float = 1e15) -> None:
        self.factor, self.cap, self.activation_cap = factor, cap, activation_cap
        self._rms: dict[tuple[str, str], tuple[float, int]] = {}  # (channel, sender or "") -> (running RMS, messages)
        self.refused: collections.Counter = collections.Counter()  # sender -> messages refused
        self._why: collections.OrderedDict[str, str] = (
            collections.OrderedDict()
        )  # sender -> its newest refusal, newest last
        self._recent: dict[
            tuple[str, str], collections.deque
        ] = {}  # (channel, sender) -> its latest WINDOW messages: refused for their RMS?
        self._lock = threading.Lock()

    def reference(self, channel: str, sender: str) -> tuple[float, str] | None:
        """(the running RMS a message is held to, whose it is), or None while warming up."""
        for key, whose in (
            ((channel, sender), f"{sender}'s {channel} messages"),
            ((channel, ""), f"this link's {channel} messages"),
        ):
            rms, n = self._rms.get(key, (0.0, 0))
            if n >= WARMUP and rms > 0:
                return rms, whose
        return None

    def check(self, channel: str, sender: str, rms: float, peak: float) -> None:
        """Accept a message of `rms` and `peak` from `sender` on `channel` (and let it move the
        running RMS), or raise WireError naming the bound it broke."""
        with self._lock:
            why, loud, recent = (
                None,
                False,
                self._recent.setdefault((channel, sender), collections.deque(maxlen=WINDOW)),
            )
            cap, setting = (
                (self.activation_cap, "security.max_activation_value")
                if channel in ACTIVATION_CHANNELS
                else (self.cap, "security.max_link_value")
            )
            if not peak <= cap:  # NaN too
                why = f"a value of magnitude {peak:.3g} exceeds the cap {cap:.3g} ({setting})"
            elif (ref := self.reference(channel, sender)) is not None and rms > self.factor * ref[0]:
                if sum(recent) < RECOVER:
                    why, loud = (
                        f"its RMS {rms:.3g} is over {self.factor:g} times the running RMS {ref[0]:.3g} of {ref[1]} (security.link_rms_factor)",
                        True,
                    )
                else:  # RECOVER refused lately: the link's level moved (or a persistent sender moved it; the cap still holds)
                    self._rms[(channel, sender)] = (rms, WARMUP - 1)
                    recent.clear()
            recent.append(loud)
            if why is not None:
                self.refused[sender] += 1
                self._why[sender] = f"{channel}: {why}"
                self._why.move_to_end(sender)
                while len(self._why) > SENDERS_KEPT:
                    self._why.popitem(last=False)
                raise WireError(f"{channel} message from {sender!r} refused ({self.refused[sender]} so far): {why}")
            for key in ((channel, sender), (channel, "")):
                old, n = self._rms.get(key, (0.0, 0))
                a = max(EMA, 1 / (n + 1))  # the plain mean while warming up
                self._rms[key] = ((1 - a) * old + a * rms, n + 1)
            if len(self._rms) > 4096:  # bounded: senders come and go
                self._rms = {k: v for k, v in self._rms.items() if k[1] == "" or v[1] >= WARMUP}
                self._recent.clear()

    def senders(self, limit: int = 4) -> list[str]:
        """The senders refused lately, newest last: "SENDER: N refused, newest: why" (the status's
        `refused_senders`: a link that keeps refusing one sender stalls, and this says why)."""
        with self._lock:
            return [
                f"{who}: {self.refused[who]} refused, newest: {why}" for who, why in list(self._why.items())[-limit:]
            ]
