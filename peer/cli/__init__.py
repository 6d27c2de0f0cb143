"""`anchormesh`, the console entry point: `bootstrap`, `peer`, `config`, `status`, `ban`, `health`,
`demo`, `export`, `data prepare`, `bench ...`.

Parsing (peer/cli/parser.py, run_parser.py, client_parser.py) and running (run_commands.py,
client_commands.py) live apart. Every usage or configuration error (a flag, a `--config` or
`--set`, an environment variable, a `--token @FILE`) exits 2 with one line `anchormesh: error:
...` naming it, before any heavy import; runtime failures (tracker unreachable, no live peer)
exit 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from peer.cli.client_commands import run_ban, run_export, run_health, run_status
from peer.cli.environ import apply_environment
from peer.cli.parser import USAGE_EXIT, build_parser
from peer.cli.run_commands import run_bootstrap, run_config, run_demo, run_peer
from peer.errors import ConfigError

_parser = build_parser  # the name tests and the Docker checks parse with


def _run_data(args: argparse.Namespace) -> None:
    from peer.dataset.cli import run_data

    run_data(args)


def _run_doctor(args: argparse.Namespace) -> None:
    from peer.doctor.run import run_doctor

    raise SystemExit(run_doctor(args))


def _run_bench(args: argparse.Namespace) -> None:
    from peer.bench.cli import run_bench

    run_bench(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": run_demo,
    "config": run_config,
    "bootstrap": run_bootstrap,
    "peer": run_peer,
    "status": run_status,
    "export": run_export,
    "ban": run_ban,
    "health": run_health,
    "data": _run_data,
    "bench": _run_bench,
    "doctor": _run_doctor,
}


def main(argv: list[str] | None = None) -> None:
    """Parse, check the environment, run the command; a ConfigError anywhere is exit 2."""
    args = build_parser().parse_args(argv)
    try:
        apply_environment(args)
        from peer.daemon.orphans import install as install_orphan_guard

        install_orphan_guard()  # before any child starts: hivemind's processes and p2pd die with this one
        COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"anchormesh: error: {exc}".replace("\n", " "), file=sys.stderr)
        raise SystemExit(USAGE_EXIT) from None
    except KeyboardInterrupt:
        print("anchormesh: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
