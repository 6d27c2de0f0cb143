"""The tree is formatted and linted as pyproject.toml says (ruff at 120 columns), so a change
that skips `ruff format` fails here rather than in the next person's diff."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ["peer", "bootstrap", "tests"]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *TREES], cwd=ROOT, capture_output=True, text=True)


def test_the_tree_is_formatted() -> None:
    out = _ruff("format", "--check")
    assert out.returncode == 0, f"run `ruff format {' '.join(TREES)}`:\n{out.stdout}{out.stderr}"


def test_no_unused_or_undefined_names_and_sorted_imports() -> None:
    out = _ruff("check", "--select", "F401,F821,F811,F841,I")
    assert out.returncode == 0, out.stdout + out.stderr
