"""What `bench boundary` (peer/bench/boundary.py) runs the codecs through: the model cut into
StageModules at the boundaries, and the corpus's tokens split into calibration and eval windows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from peer.errors import ConfigError
from peer.model.stages import StageModule, lm_loss

# ---- the model, cut at the boundaries ------------------------------------------------------------


class Chain:
    """The model as StageModules cut after each boundary layer, so one pass yields every
    boundary's hidden state and a loss can resume from any boundary."""

    def __init__(self, model, boundaries: list[int]) -> None:
        n = model.config.num_hidden_layers
        if not boundaries or sorted(set(boundaries)) != list(boundaries) or boundaries[0] < 1 or boundaries[-1] >= n:
            raise ConfigError("boundaries", boundaries, f"must be increasing layer counts in [1, {n - 1}]")
        edges = [0, *boundaries, n]
        self.boundaries = list(boundaries)
        self.segments = [
            StageModule(model, i, edges[i], edges[i + 1], len(edges) - 1).eval() for i in range(len(edges) - 1)
        ]

    @torch.no_grad()
    def hidden(self, ids: Tensor, batch: int = 4) -> list[Tensor]:
        """The hidden state after each boundary layer, [N, T, H] each, for token windows ids [N, T]."""
        outs: list[list[Tensor]] = [[] for _ in self.boundaries]
        for i in range(0, len(ids), batch):
            h = ids[i : i + batch]
            for j, seg in enumerate(self.segments[:-1]):
                h = seg(h)
                outs[j].append(h)
        return [torch.cat(o) for o in outs]

    @torch.no_grad()
    def loss_from(self, j: int, h: Tensor, targets: Tensor, batch: int = 2) -> float:
        """Mean next-token loss when the hidden state after boundary j is `h` [N, T, H]."""
        total = 0.0
        for i in range(0, len(h), batch):
            x = h[i : i + batch]
            for seg in self.segments[j + 1 :]:
                x = seg(x)
            total += float(lm_loss(x, targets[i : i + batch])) * len(x)
        return total / len(h)

    def grad_from(self, j: int, h: Tensor, targets: Tensor, batch: int = 1) -> Tensor:
        """dL/dh [N, T, H] of the mean next-token loss of each window w.r.t. the hidden state after
        boundary j (what the receiving stage sends back in a backward pass)."""
        grads = []
        for i in range(0, len(h), batch):
            x = h[i : i + batch].detach().clone().requires_grad_(True)
            y = x
            for seg in self.segments[j + 1 :]:
                y = seg(y)
            lm_loss(y, targets[i : i + batch]).backward()
            grads.append(x.grad)
        return torch.cat(grads)

    @torch.no_grad()
    def dense_loss(self, ids: Tensor, targets: Tensor, batch: int = 2) -> float:
        total = 0.0
        for i in range(0, len(ids), batch):
            x = ids[i : i + batch]
            for seg in self.segments:
                x = seg(x)
            total += float(lm_loss(x, targets[i : i + batch])) * len(x)
        return total / len(ids)


# ---- text ----------------------------------------------------------------------------------------


def token_ids(model: str, corpus: Path | None) -> tuple[Tensor, str, Callable[[list[int]], str]]:
    """(every token id of the corpus, where it came from, a decoder for reports). Byte ids for the
    tiny models, the model's own tokenizer otherwise; default corpus: the built-in Python one."""
    from peer.data import default_corpus, read_path

    if corpus is not None:
        data, source = read_path(corpus, name="corpus"), str(corpus)
    else:
        data, source = default_corpus("b")
    if model.startswith("tiny-"):
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).long(),
            source,
            lambda ids: bytes(ids).decode("utf-8", "replace"),
        )
    from peer.model.source import load_tokenizer

    tok = load_tokenizer(model)
    ids = torch.tensor(tok(data.decode("utf-8", "replace"), add_special_tokens=False)["input_ids"], dtype=torch.long)
    return ids, source, lambda t: tok.decode(t)


def split_windows(ids: Tensor, seq_len: int, n_calib: int, n_eval: int) -> tuple[Tensor, Tensor]:
    """Non-overlapping [n, seq_len + 1] windows: calibration spread over the first half of the
    corpus, eval over the second half (so no fit sees an eval token)."""
    half, w = len(ids) // 2, seq_len + 1

    def spread(part: Tensor, n: int, what: str) -> Tensor:
        slots = len(part) // w
        if slots < n:
            raise ConfigError(
                "corpus",
                None,
                f"its {what} half holds {slots} windows of {w} tokens; need {n} (use a larger corpus or fewer tokens)",
            )
        starts = [(k * slots // n) * w for k in range(n)]
        return torch.stack([part[s : s + w] for s in starts])

    return spread(ids[:half], n_calib, "first"), spread(ids[half:], n_eval, "second")
