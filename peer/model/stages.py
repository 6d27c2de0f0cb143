"""Cut a causal LM into K contiguous pipeline stages.

Stage 0 owns the embeddings (it reads token ids), stage K-1 owns the final norm and the head
(it computes the loss); every stage owns a contiguous range of decoder layers. Each stage holds
its own copy of the modules, so a tied embedding/head (GPT-2) becomes two parameters, one on
each end, as in Petals. `hf_names` maps every stage parameter back to the full model's name,
which the equality test and checkpoint export use.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from peer.errors import ConfigError, TensorError

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")  # the decoder layouts `split_model` knows


def family_of(model: PreTrainedModel) -> str:
    family = model.config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError(
            "model.name",
            getattr(model.config, "_name_or_path", family),
            f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}",
        )
    return family


class GPT2Embedding(nn.Module):
    """Token plus learned position embedding (GPT-2 keeps them outside its blocks)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos)[None])


@dataclass
class _Parts:
    """Where a family keeps its pieces, as (module, hf_prefix)."""

    embed: tuple[nn.Module, str | tuple[str, ...]]
    layers: nn.ModuleList
    layers_prefix: str
    norm: tuple[nn.Module, str]
    head: tuple[nn.Module, str]
    rotary: nn.Module | None


def _parts(model: PreTrainedModel) -> _Parts:
    family = family_of(model)
    if family == "gpt2":
        tr = model.transformer
        return _Parts(
            embed=(GPT2Embedding(tr.wte, tr.wpe, tr.drop), ("transformer.wte", "transformer.wpe", "")),
            layers=tr.h,
            layers_prefix="transformer.h",
            norm=(tr.ln_f, "transformer.ln_f"),
            head=(model.lm_head, "lm_head"),
            rotary=None,
        )
    backbone = model.model  # llama, qwen2, mistral share this layout
    return _Parts(
        embed=(backbone.embed_tokens, "model.embed_tokens"),
        layers=backbone.layers,
        layers_prefix="model.layers",
        norm=(backbone.norm, "model.norm"),
        head=(model.lm_head, "lm_head"),
        rotary=backbone.rotary_emb,
    )


class StageModule(nn.Module):
    """Layers [start, end) of a causal LM, plus embeddings (first stage) or norm + head (last).

    Input: token ids [B, T] (first stage) or hidden states [B, T, H]. Output: logits [B, T, V]
    (last stage) or hidden states [B, T, H].
    """

    def __init__(self, model: PreTrainedModel, index: int, start: int, end: int, num_stages: int) -> None:
        super().__init__()
        parts = _parts(model)
        self.family = family_of(model)
        self.index, self.num_stages, self.start, self.end = index, num_stages, start, end
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.checkpointing = False  # per-layer activation checkpointing (compute.activation_checkpointing)
        self.hf_names: dict[str, str] = {}
        self.embed = copy.deepcopy(parts.embed[0]) if self.is_first else None
        self.layers = nn.ModuleList(copy.deepcopy(parts.layers[i]) for i in range(start, end))
        self.norm = copy.deepcopy(parts.norm[0]) if self.is_last else None
        self.head = copy.deepcopy(parts.head[0]) if self.is_last else None
        self.rotary = copy.deepcopy(parts.rotary) if parts.rotary is not None else None
        for name, _ in self.named_parameters():
            self.hf_names[name] = self._hf_name(name, parts)

    def _hf_name(self, name: str, parts: _Parts) -> str:
        head, _, rest = name.partition(".")
        if head == "layers":
            i, _, rest = rest.partition(".")
            return f"{parts.layers_prefix}.{self.start + int(i)}.{rest}"
        if head == "embed":
            prefix = parts.embed[1]
            if isinstance(prefix, tuple):  # GPT2Embedding: wte.weight -> transformer.wte.weight
                sub, _, rest = rest.partition(".")
                return f"transformer.{sub}.{rest}"
            return f"{prefix}.{rest}"
        if head == "norm":
            return f"{parts.norm[1]}.{rest}"
        if head == "head":
            return f"{parts.head[1]}.{rest}"
        raise KeyError(name)

    def decoder_matrices(self) -> set[str]:
        """Names of 2-D decoder weight matrices: what the spectral correction may touch."""
        return {n for n, p in self.named_parameters() if n.startswith("layers.") and p.ndim == 2}

    def check_input(self, x: torch.Tensor) -> None:
        """Reject a wrong dtype or shape before it reaches the layers."""
        if self.is_first:
            if x.dtype != torch.long or x.ndim != 2:
                raise TensorError(
                    f"stage {self.index} input: expected token ids long [B, T], got {x.dtype} {tuple(x.shape)}"
                )
            # the value check reads the ids, a host sync on a device: the caller checks host ids first
            if x.numel() and x.device.type == "cpu" and (int(x.min()) < 0 or int(x.max()) >= self.vocab_size):
                raise TensorError(
                    f"stage {self.index} input: token ids must be in [0, {self.vocab_size}), got [{int(x.min())}, {int(x.max())}]"
                )
        elif not x.is_floating_point() or x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise TensorError(
                f"stage {self.index} input: expected hidden states float [B, T, {self.hidden_size}], got {x.dtype} {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        h = self.embed(x) if self.is_first else x
        kwargs = {}
        if self.rotary is not None:
            pos = torch.arange(h.shape[1], device=h.device)[None]
            kwargs = {"position_ids": pos, "position_embeddings": self.rotary(h, pos)}
        for layer in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                # keep only the layer's input; its activations are recomputed in the backward,
                # with the weights this forward saw (under functional_call: a working copy or a
                # stash), which the recompute, running after the call returned, would not find
                weights = dict(layer.named_parameters())
                out = checkpoint(_layer_with, layer, weights, h, kwargs, use_reentrant=False)
            else:
                out = layer(h, attention_mask=None, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            return self.head(self.norm(h))
        return h


def _layer_with(
    layer: nn.Module, weights: dict[str, torch.Tensor], h: torch.Tensor, kwargs: dict
) -> torch.Tensor | tuple:
    """One decoder layer on the given weights (what activation checkpointing recomputes)."""
    return functional_call(layer, weights, (h,), {"attention_mask": None, **kwargs})


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `targets` are the inputs shifted by one, [B, T]."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, as-even-as-possible layer ranges; earlier stages take the remainder."""
    if not (1 <= num_stages <= num_layers):
        raise ConfigError("model.num_stages", num_stages, f"must be in [1, num_layers={num_layers}]")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def split_model(model: PreTrainedModel, num_stages: int) -> list[StageModule]:
    """K stages that together compute exactly what `model` computes."""
    ranges = layer_ranges(model.config.num_hidden_layers, num_stages)
    return [StageModule(model, i, s, e, num_stages) for i, (s, e) in enumerate(ranges)]


def merged_state_dict(stages: list[StageModule]) -> dict[str, torch.Tensor]:
    """The stages' parameters under the full model's names (for export and comparisons)."""
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            out[stage.hf_names[name]] = p.detach()
    return out
