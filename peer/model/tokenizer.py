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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the `tokenizers` ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def hf_byte_tokenizer(model_max_length: int):
    """`ByteTokenizer` as a Hugging Face fast tokenizer (token id = byte value), so an exported model
    loads with `AutoTokenizer.from_pretrained`. Why this construction: Hugging Face has no plain
    256-byte tokenizer (ByT5's shifts ids by 3); a byte-level BPE with no merges over the 256 byte
    symbols, ordered by byte value, encodes and decodes exactly like `ByteTokenizer`. No special
    tokens: the swarm's data has none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length)
