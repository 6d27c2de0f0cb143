"""Each doctor check as a pure function: plain inputs in (what nvidia-smi printed, the size of
/dev/shm, whether a port binds, ...), one `Check` out. No I/O here, so every verdict and its
advice is tested with fake inputs; peer/doctor/run.py gathers the real ones."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
GIB = 2**30
MIB = 2**20
SHM_FAIL_BYTES = 256 * MIB  # Docker's default /dev/shm is 64 MiB: the DHT and data loaders run out
SHM_WARN_BYTES = 1 * GIB
DISK_FAIL_BYTES = 1 * GIB  # a checkpoint of a stage and the run's data shards go to the state dir
DISK_WARN_BYTES = 10 * GIB
SKEW_WARN_S = 2.0  # dp averaging rounds start at wall-clock slots
SKEW_FAIL_S = 30.0


@dataclass(frozen=True)
class Check:
    """One line of the report: `status` is ok, warn, fail or skip; `detail` says what was seen and,
    when not ok, what to do."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<8}  {self.detail}"


def gpu(smi: str | None) -> Check:
    """From `nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader,nounits`
    (None: no nvidia-smi, or it failed). No GPU is a warning: a peer trains on the CPU, slowly."""
    rows = [[x.strip() for x in r.split(",")] for r in (smi or "").strip().splitlines() if r.strip()]
    if not rows:
        return Check("gpu", WARN, "no NVIDIA GPU seen (nvidia-smi absent or failing): the peer trains on the CPU")
    parts = [f"{r[0]}, {int(r[2]) / 1024:.1f} GiB" if len(r) > 2 and r[2].isdigit() else r[0] for r in rows]
    driver = rows[0][1] if len(rows[0]) > 1 else "?"
    return Check("gpu", OK, f"{len(rows)} GPU: {'; '.join(parts)}; driver {driver}")


def torch_build(version: str | None, cuda_build: str | None, cuda_available: bool, gpu_seen: bool) -> Check:
    """The torch the peer would run with. `version` None: torch is not installed (a fail);
    `cuda_build` None: a CPU build, a warning when there is a GPU it cannot use."""
    if version is None:
        return Check("torch", FAIL, "torch is not installed: install anchormesh with its dependencies")
    if cuda_build is None:
        if gpu_seen:
            return Check(
                "torch",
                WARN,
                f"torch {version} is a CPU build: the GPU goes unused; install the CUDA wheel (pip install torch --index-url https://download.pytorch.org/whl/cu124)",
            )
        return Check("torch", OK, f"torch {version}, CPU build (no GPU here)")
    if not cuda_available:
        return Check(
            "torch",
            FAIL if gpu_seen else WARN,
            f"torch {version} is built for CUDA {cuda_build} but sees no CUDA device: the driver may be older than CUDA {cuda_build} needs, or CUDA_VISIBLE_DEVICES hides the GPU",
        )
    return Check("torch", OK, f"torch {version}, CUDA {cuda_build} build, a CUDA device is visible")


def shm(size_bytes: int | None) -> Check:
    """/dev/shm's size (None: no /dev/shm, e.g. macOS)."""
    if size_bytes is None:
        return Check("shm", WARN, "no /dev/shm: shared-memory tensors fall back to files")
    size = f"/dev/shm is {size_bytes / MIB:.0f} MiB"
    if size_bytes < SHM_FAIL_BYTES:
        return Check(
            "shm", FAIL, f"{size} (Docker's default is 64 MiB): too small; run the container with --shm-size=1g"
        )
    if size_bytes < SHM_WARN_BYTES:
        return Check("shm", WARN, f"{size}: 1 GiB or more is safer (docker run --shm-size=1g)")
    return Check("shm", OK, size)


def port(flag: str, host: str, number: int, error: str) -> Check:
    """Whether the port a peer would bind is free: `number` 0 is any free port; `error` is why the
    bind failed ("" when it bound)."""
    name = flag.lstrip("-").replace("-port", "")
    if error:
        return Check(
            name, FAIL, f"{flag} {number} on {host} cannot be bound ({error}): free it or choose another {flag}"
        )
    if number == 0:
        return Check(name, OK, f"{flag} 0: any free port on {host}; fix one with {flag} N to forward it through NAT")
    return Check(name, OK, f"{flag} {number} is free on {host}; forward TCP {number} to this machine behind NAT")


def clock(skew_s: float | None, why_not: str = "") -> Check:
    """The clock's offset from the tracker's (None: not measured, `why_not` says why)."""
    if skew_s is None:
        return Check("clock", SKIP, why_not or "not measured")
    text = f"{abs(skew_s):.1f} s {'ahead of' if skew_s > 0 else 'behind'} the tracker"
    if abs(skew_s) >= SKEW_FAIL_S:
        return Check(
            "clock", FAIL, f"{text}: averaging rounds would never line up; enable NTP (timedatectl set-ntp true)"
        )
    if abs(skew_s) >= SKEW_WARN_S:
        return Check("clock", WARN, f"{text}: enable NTP (timedatectl set-ntp true)")
    return Check("clock", OK, text)


def disk(path: str, free_bytes: int | None, given: bool = True) -> Check:
    """Free space where the state dir goes (None: the path cannot be checked); `given`: the
    volunteer named it (without --state-dir a peer keeps no checkpoints, and this checks `path`)."""
    if free_bytes is None:
        return Check("disk", FAIL, f"{path}: cannot be created or read; pass a writable --state-dir")
    text = f"{free_bytes / GIB:.1f} GiB free in {path}"
    if not given:
        text += " (no --state-dir: give the one the peer will use)"
    if free_bytes < DISK_FAIL_BYTES:
        return Check(
            "disk", FAIL, f"{text}: checkpoints and data shards need more; free space or use another --state-dir"
        )
    if free_bytes < DISK_WARN_BYTES:
        return Check("disk", WARN, f"{text}: a large model's stage checkpoints may not fit")
    return Check("disk", OK, text)


def memory(device: str, needs: list[int] | None, usable: int, why_not: str = "") -> Check:
    """The run's memory plan per stage against the memory this peer may use on `device`
    (None: no plan, `why_not` says why). A peer that fits some stages joins: the tracker gives it one of them."""
    if needs is None:
        return Check("memory", SKIP, why_not or "no run config")
    plan = ", ".join(f"{n / GIB:.2f}" for n in needs)
    fits = [i for i, n in enumerate(needs) if n <= usable]
    text = f"{usable / GIB:.2f} GiB usable on {device}; the run needs {plan} GiB per stage"
    if not fits:
        return Check(
            "memory",
            FAIL,
            f"{text}: no stage fits; lower compute.memory_budget_gib on the run, free memory, or use a bigger device",
        )
    if len(fits) < len(needs):
        return Check("memory", WARN, f"{text}: only stage {', '.join(map(str, fits))} fit; the tracker places it there")
    return Check("memory", OK, text)


def tracker(address: str, error: str, run_id: str = "", theirs: str = "", ours: str = "") -> Check:
    """Whether the tracker answered and speaks this build's wire version."""
    if error:
        return Check("tracker", FAIL, f"{address}: {error}")
    if theirs != ours:
        return Check(
            "tracker",
            FAIL,
            f"{address} serves {run_id} on wire version {theirs}, this build speaks {ours}: install the run's anchormesh version",
        )
    return Check("tracker", OK, f"{address} serves {run_id}, wire version {ours}")


def exit_code(checks: list[Check]) -> int:
    """0 when nothing failed, 1 when a check failed."""
    return 1 if any(c.status == FAIL for c in checks) else 0
