"""One torch thread in the test process, and each test's time limit by its tier.

Threads. Why: the suite runs on 2 cores beside the peer, tracker
and hivemind processes it starts; torch's OpenMP threads spin while they wait, and with a
second busy process on the box a tiny model's step took 80x longer with 2 threads than with 1
(0.42 s against 33.6 s for 12 runner steps). Tests that need more set it themselves and restore it.

Time limits (pytest-timeout). A quick test (the `make check` tier) gets pyproject's `timeout`
(60 s); a test marked `processes` or `slow` gets LONG_TIMEOUT_S unless it carries its own
`@pytest.mark.timeout`. `--timeout N` (or PYTEST_TIMEOUT) on the command line sets every test's
limit. A test past its limit fails with pytest-timeout's message, every thread's stack, and the
note below; the run goes on with the next test (tests/README.md)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)

LONG_TIMEOUT_S = 600.0  # processes and slow tests: a swarm of real processes on 2 busy cores


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
