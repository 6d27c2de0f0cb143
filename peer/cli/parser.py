"""The `anchormesh` parser: every command's flags, nothing imported that parsing does not need.

A usage error answers like every other configuration error: one line `anchormesh: error: ...`
on stderr and exit code 2 (argparse's default prints the usage block above it).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from peer.cli.client_parser import add_ban, add_export, add_health, add_status
from peer.cli.run_parser import add_bootstrap, add_config, add_demo, add_peer

USAGE_EXIT = 2  # a bad flag, value, config or environment variable; runtime failures exit 1


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the command's help."""

    def error(self, message: str) -> NoReturn:
        print(f"anchormesh: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(USAGE_EXIT)


class VersionAction(argparse.Action):
    """`--version`: the build line, computed only when asked (the wire version imports torch)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        from peer import __version__
        from peer.build import commit
        from peer.wire.version import wire_version  # the codecs' constants: imports torch

        print(f"anchormesh {__version__} (git {commit()}, wire {wire_version()})")
        raise SystemExit(0)


def build_parser() -> Parser:
    """The whole command line; `bench`, `data` and `doctor` bring their own subcommands."""
    p = Parser(prog="anchormesh", description="Peer-to-peer pipeline training over slow links.")
    p.add_argument(
        "--version", action=VersionAction, help="print `anchormesh VERSION (git COMMIT, wire WIRE_VERSION)` and exit"
    )
    sub = p.add_subparsers(dest="command", required=True)
    for add in (add_demo, add_bootstrap, add_config, add_peer, add_status, add_ban, add_health, add_export):
        add(sub)
    # the benchmarks' package: only the entry point's package imports it (tests/test_layout.py)
    from peer.bench.parser import add_bench_parser

    add_bench_parser(sub)
    from peer.dataset.cli import add_data_parser

    add_data_parser(sub)
    from peer.doctor.run import add_doctor_parser

    add_doctor_parser(sub)
    return p
