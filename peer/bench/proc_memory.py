"""Memory of the processes a quality bench runs (Linux /proc), and handing back what a row left.

Why a module of its own: both quality benches report it per row and per peer (a run that grows
row after row is one that gets killed: the SmolLM2 run reached 23.7 GB), and reading /proc has
nothing to do with training.
"""

from __future__ import annotations

from pathlib import Path


def rss_gb(pid: int | str = "self") -> float | None:
    """A process's resident memory now (Linux; this one by default), GB; None elsewhere or once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1e6
    except (OSError, StopIteration, ValueError):
        return None


def tree_pss_gb(pid: int) -> float | None:
    """The proportional resident memory (Pss: shared pages split among their sharers) of a process
    and every process under it, GB (Linux); None once it has exited. Why Pss of the tree: a peer's
    forked averaging process and its p2pd count against the machine too, and summing their RSS
    would count the pages a fork shares twice."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo, seen = 0.0, [pid], False
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("Pss:")) / 1e6
            seen = True
        except (OSError, StopIteration, ValueError):
            pass
        todo += children.get(p, [])
    return total if seen else None


def release_memory() -> None:
    """Free what the last row left (the SmolLM2 run grew to 23.7 GB by its tenth row and was
    killed, though no tensor outlives a row; each row's `rss_gb_after` shows whether this holds)."""
    from peer.model.loading import trim_host_memory

    trim_host_memory()
