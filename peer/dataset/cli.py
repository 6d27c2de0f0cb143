"""`anchormesh data ...`: the data commands' command line (parsed here, run by `prepare.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from peer.dataset.manifest import DEFAULT_HELDOUT_FRACTION, DEFAULT_MIN_HELDOUT_TOKENS, DEFAULT_SHARD_TOKENS


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """The `data` subcommand and its subcommands, on the entry point's parser."""
    data = sub.add_parser("data", help="operator: prepare a run's training data once (token shards + manifest)")
    dsub = data.add_subparsers(dest="data", required=True)
    p = dsub.add_parser(
        "prepare",
        help="tokenize a text file, a folder of text files or a Hugging Face dataset into token shards, a document index and manifest.json",
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a text file, a folder of text files (.txt, .md, .rst, .py or no suffix), "
        "or hf:DATASET[:CONFIG[:SPLIT]] (streamed with `datasets`)",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="bytes (the tiny models' byte ids), smollm2-135m, or a Hugging Face model id, folder or .gguf file whose tokenizer to use",
    )
    p.add_argument("--out", required=True, type=Path, help="folder to create (must not exist or be empty)")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS}); memory is about three shards",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=DEFAULT_HELDOUT_FRACTION,
        help=f"share of documents held out for evaluation (default {DEFAULT_HELDOUT_FRACTION})",
    )
    p.add_argument(
        "--confirm-fraction",
        type=float,
        default=DEFAULT_HELDOUT_FRACTION,
        help=f"share of documents held out as a confirmation set, never evaluated during a run (default {DEFAULT_HELDOUT_FRACTION})",
    )
    p.add_argument(
        "--min-heldout-tokens",
        type=int,
        default=DEFAULT_MIN_HELDOUT_TOKENS,
        help=f"refuse a source whose train, eval or confirmation split gets fewer tokens (default {DEFAULT_MIN_HELDOUT_TOKENS})",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the document hash that picks the held-out documents (default 0)"
    )
    p.add_argument("--text-field", default="text", help="with hf:...: the column holding the text (default text)")
    p.add_argument("--force", action="store_true", help="replace --out if it holds a prepared folder")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the progress bar (default: when stderr is a terminal)",
    )


def run_data(args: argparse.Namespace) -> None:
    from peer.dataset.prepare import prepare

    if args.data == "prepare":
        prepare(
            args.source,
            args.tokenizer,
            args.out,
            shard_tokens=args.shard_tokens,
            eval_fraction=args.eval_fraction,
            confirm_fraction=args.confirm_fraction,
            min_heldout_tokens=args.min_heldout_tokens,
            seed=args.seed,
            text_field=args.text_field,
            force=args.force,
            show_progress=args.progress,
        )
