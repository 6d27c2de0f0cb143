"""Which build this is: the package version and the git commit it runs from.

`__version__` alone cannot tell two peers of one release apart, and a swarm on slow links is
often a mix of checkouts; the build (`VERSION+COMMIT`, e.g. `0.1.0+3f2a1bc`) is what a peer
reports at Join, the tracker keeps per peer and the status shows. The commit is read from the
checkout's `.git` files (no `git` process, no heavy import: `anchormesh --version` and every
Join ask for it); outside a checkout it comes from `$ANCHORMESH_COMMIT` (the Docker images set it
from a build arg), else it is `unknown`.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

from peer import __version__

COMMIT_ENV = "ANCHORMESH_COMMIT"
UNKNOWN = "unknown"
SHORT = 7  # hex digits of the commit shown
_SHA = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1 or SHA-256 object names


def _git_dir(root: Path) -> Path | None:
    """The git directory of the checkout at `root`; a worktree's `.git` is a file naming it."""
    dotgit = root / ".git"
    if dotgit.is_dir():
        return dotgit
    if dotgit.is_file():
        line = dotgit.read_text().strip()
        if line.startswith("gitdir:"):
            return (root / line[len("gitdir:") :].strip()).resolve()
    return None


def _resolve(git: Path, ref: str) -> str | None:
    """The object name `ref` points to: a loose ref in the worktree's or the common git
    directory, else a line of packed-refs."""
    common = git / (git / "commondir").read_text().strip() if (git / "commondir").is_file() else git
    for base in (git, common):
        if (base / ref).is_file():
            return (base / ref).read_text().strip()
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name.strip() == ref:
                return sha
    return None


def commit_of(root: Path) -> str | None:
    """The short commit checked out at `root`, or None when `root` is no readable checkout."""
    try:
        git = _git_dir(root)
        if git is None:
            return None
        head = (git / "HEAD").read_text().strip()
        sha = _resolve(git, head[len("ref:") :].strip()) if head.startswith("ref:") else head
    except OSError:
        return None
    return sha[:SHORT] if sha and _SHA.fullmatch(sha) else None


@cache
def commit() -> str:
    """The short commit this package runs from: its checkout's, else $ANCHORMESH_COMMIT, else unknown."""
    found = commit_of(Path(__file__).resolve().parents[1])
    return found or os.environ.get(COMMIT_ENV, "").strip()[:40] or UNKNOWN


def build() -> str:
    """`VERSION+COMMIT`: what a peer reports at Join and the status shows per peer."""
    return f"{__version__}+{commit()}"


def release_of(build_id: str) -> str:
    """The package version of a build string (an older build sent the bare version)."""
    return build_id.partition("+")[0]
