"""Byte-level tokenizer: vocabulary of 256 bytes, nothing to download."""

from __future__ import annotations

import torch

VOCAB_SIZE = 256


class ByteTokenizer:
    """UTF-8 bytes are the tokens. Why: tests and the demo need a tokenizer that works offline."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
