"""What a peer accepts on the anchor circuit (peer/pipeline/swarm_anchor.py), checked on the
transport's threads before a message is queued.

Why a module of its own: it is the anchor circuit's security boundary, read and changed apart from
the work the circuit does. An anchor activation must be dense, on this stage's boundary, for a
micro-batch the pass has and (not an evaluation) an anchor id the tracker may have issued, with
tokens and a hidden state of the run's shapes within the link's bounds; an anchor gradient must
match the output it answers; a prior must come from a live peer of this stage group and name
only this stage's decoder matrices, each of its shape. A message for a pass that expired here
is let through and dropped in the loop: a refusal would end the sender's stream and lose what
it held.
"""

from __future__ import annotations

import torch

from peer.errors import WireError
from peer.pipeline.bounds import scale_of
from peer.pipeline.inbound import check_token_window
from peer.wire.tensors import proto_to_tensor

ISSUE_SLACK = 2  # anchor ids this far above the newest issued one this peer heard of may be real (issued since its last heartbeat)


class AnchorChecks:
    """The inbound checks of `SwarmAnchor` (a mixin: it reads the anchor's worker `w`, `jobs`,
    `issued`, `siblings`, `targets`, `shapes`, `micro_batches` and `eval_batches`)."""

    def _check_issued(self, anchor_id: int) -> None:
        if self.issued is not None and anchor_id > self.issued + ISSUE_SLACK:
            raise WireError(f"anchor id {anchor_id}: the tracker has issued only up to {self.issued}")

    def validate(self, channel: str, msg: object) -> None:
        """Vet an inbound anchor message before it is queued (transport threads)."""
        s = self.w.stage
        if channel == "anchor_forward":
            if not msg.header.dense:
                raise WireError("header.dense=false: anchor activations travel dense")
            if msg.header.boundary != s.index - 1:
                raise WireError(
                    f"header.boundary={msg.header.boundary}: stage {s.index} receives activations on boundary {s.index - 1}"
                )
            if not msg.header.eval:
                self._check_issued(msg.header.step)
            limit, what = (self.eval_batches, "an evaluation") if msg.header.eval else (self.micro_batches, "an anchor")
            if msg.header.micro_batch_id >= limit:
                raise WireError(f"micro_batch_id={msg.header.micro_batch_id}: {what} pass has {limit} micro-batches")
            p = self.w.cfg.pipeline
            check_token_window(msg.token_ids, s.vocab_size, (p.micro_batch_size, p.seq_len + 1))
            hidden = proto_to_tensor(
                msg.hidden, expect_shape=(p.micro_batch_size, p.seq_len, s.hidden_size), expect_dtype=torch.float16
            )
            self.w.bounds.check(
                channel, msg.header.sender, *scale_of(hidden)
            )  # its own link: dense, not the fast circuit's scale
        elif channel == "anchor_backward":
            if msg.header.boundary != s.index:
                raise WireError(
                    f"header.boundary={msg.header.boundary}: stage {s.index} receives gradients on boundary {s.index}"
                )
            job = self.jobs.get(msg.header.step)
            pending = job.pending.get(msg.header.micro_batch_id) if job else None
            if pending is None:  # a pass that expired here: dropped in the loop, not refused (see the module doc)
                proto_to_tensor(msg.grad, expect_dtype=torch.float16)
                return
            grad = proto_to_tensor(msg.grad, expect_shape=tuple(pending.out.shape), expect_dtype=torch.float16)
            self.w.bounds.check(channel, msg.header.sender, *scale_of(grad))
        elif channel == "prior":
            if msg.stage != s.index:
                raise WireError(f"stage={msg.stage}: this peer serves stage {s.index}")
            if msg.header.sender not in self.siblings():
                raise WireError(f"header.sender={msg.header.sender!r} is not a live peer of this stage group")
            self._check_issued(msg.header.micro_batch_id)
            names = [g.name for g in msg.grads]
            unknown = sorted(set(names) - self.targets)
            if unknown or len(set(names)) != len(names) or not names:
                raise WireError(
                    f"grads: names must be distinct decoder matrices of stage {s.index}; got unknown {unknown[:3]} of {len(names)}"
                )
            for g in msg.grads:
                proto_to_tensor(g.tensor, expect_shape=self.shapes[g.name], expect_dtype=torch.bfloat16)
        else:
            raise WireError(f"channel={channel!r} is not an anchor channel")
