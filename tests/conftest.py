"""One torch thread in the test process, and each test's time limit by its tier.

Threads. Why: the suite runs on 2 cores beside the peer, tracker
and hivemind processes it starts; torch's OpenMP threads spin while they wait, and with a
second busy process on the box a tiny model's step took 80x longer with 2 threads than with 1
(0.42 s against 33.6 s for 12 runner steps). Tests that need more set it themselves and restore it.

Time limits (pytest-timeout). A quick test (the `make check` tier) gets pyproject's `timeout`
(60 s); a test marked `processes` or `slow` gets LONG_TIMEOUT_S unless it carries its own
`@pytest.mark.timeout`. `--timeout N` (or PYTEST_TIMEOUT) on the command line sets every test's
limit. A test past its limit fails with pytest-timeout's message, every thread's stack, and the
note below; the run goes on with the next test (tests/README.md).

Unmarked tests that start processes. Every fork (hivemind's DHT and averagers, multiprocessing)
and every Python, p2pd or `ip` child is noted per test; one not marked `processes` is listed at the
end of the run (a report, not a failure), so `make check` stays free of them. Other tools (ruff,
git, mount) are not counted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

torch.set_num_threads(1)

LONG_TIMEOUT_S = 600.0  # processes and slow tests: a swarm of real processes on 2 busy cores

_started: list[str] = []  # what the running test started (forks, counted children)
_unmarked: list[tuple[str, str]] = []  # (test, first thing it started) for tests not marked processes
os.register_at_fork(before=lambda: _started.append("a forked process"))
_execute_child = subprocess.Popen._execute_child


def _argv(args) -> list[str]:
    return [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]


def _counted(argv: list[str]) -> bool:
    program = os.path.basename(argv[0].split()[0]) if argv and argv[0].strip() else ""
    if program.startswith("python") or (argv and argv[0] == sys.executable):
        return argv[1:3] != ["-m", "ruff"]
    return program in ("ip", "p2pd") or "peer.cli" in " ".join(argv)


def _execute_child_noted(self, args, *rest, **kw):
    argv = _argv(args)
    if _counted(argv):
        _started.append(" ".join(argv).replace("\n", " ")[:100])
    return _execute_child(self, args, *rest, **kw)


subprocess.Popen._execute_child = _execute_child_noted


def _limit_given(config: pytest.Config) -> bool:
    return config.getoption("timeout", None) is not None or bool(os.environ.get("PYTEST_TIMEOUT"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _limit_given(config):
        return
    for item in items:
        long = item.get_closest_marker("processes") or item.get_closest_marker("slow")
        if long and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _started.clear()
    yield
    if _started and item.get_closest_marker("processes") is None:
        _unmarked.append((item.nodeid, _started[0]))


def pytest_terminal_summary(terminalreporter) -> None:
    if _unmarked:
        terminalreporter.section("tests that started processes but are not marked processes")
        for nodeid, what in _unmarked:
            terminalreporter.line(f"{nodeid}: {what}")
        terminalreporter.line(
            "mark them `@pytest.mark.processes` (tests/README.md): `make check` is meant to start none"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "from pytest-timeout" in report.longreprtext:
        tier = "processes/slow" if item.get_closest_marker("processes") or item.get_closest_marker("slow") else "quick"
        report.sections.append(
            (
                "time limit",
                f"{item.nodeid} ran past its time limit ({tier} tier). A test that starts processes is marked "
                "`processes`, an in-process one that needs over ~10 s `slow`: both get "
                f"{LONG_TIMEOUT_S:.0f} s; the quick tier (`make check`) has pyproject's `timeout`.",
            )
        )
