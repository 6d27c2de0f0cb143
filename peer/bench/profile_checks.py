"""What the security checks cost on the bed: py-spy samples attributed to the code that checks.

Why apart from `bench profile`'s parts: the checks are spread over the peer's main process (link
bounds, call admission and authentication), hivemind's children (DHT request signatures, the
averaging round's commitments, audits and claims) and the bootstrap (report bounds), and most of
them cannot be switched off to measure a before and after without opening the hole they close.
So each sample goes to the innermost anchormesh frame on its stack: when that frame is in a
check, the sample (the library code it called included) is the check's. TLS runs in gRPC's C
core and in p2pd, where py-spy sees nothing: `bench profile --tls both` measures it as a real
before and after instead (`--insecure-plaintext` on every process of the bed).
"""

from __future__ import annotations

import collections
import re
import statistics
from pathlib import Path

from peer.bench.profile_samples import samples

# (check, path of its module, functions of that module that are not checks: wrappers whose
# innermost-anchormesh samples are the parsing or handling they wrap)
CHECKS: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("link bounds", "peer/pipeline/bounds.py", frozenset()),
    ("anchor message checks", "peer/pipeline/anchor_checks.py", frozenset()),
    ("call admission", "peer/security/admission.py", frozenset({"call", "_receive"})),
    ("call authentication", "peer/security/auth.py", frozenset()),
    ("call authentication", "peer/security/call_check.py", frozenset()),
    ("message size limits", "peer/security/limits.py", frozenset({"call", "deserialize", "one", "each"})),
    ("DHT request signatures", "peer/security/dht_auth.py", frozenset()),
    ("DHT request signatures", "peer/security/identity.py", frozenset()),
    ("tracker record checks", "peer/security/tracker_record.py", frozenset()),
    ("round commitments and audits", "peer/dp/audit.py", frozenset()),
    ("round commitments and audits", "peer/dp/commitment.py", frozenset()),
    ("round claims and signatures", "peer/dp/signed_claims.py", frozenset()),
    ("round claims and signatures", "peer/dp/claims.py", frozenset()),
    ("lean tracking", "peer/dp/steering.py", frozenset()),
    ("trimmed mean", "peer/dp/robust.py", frozenset({"reducer_class", "runner_class"})),
    ("report bounds", "bootstrap/report_bounds.py", frozenset()),
)
OURS = re.compile(r"(?:^|[/ (])((?:peer|bootstrap)/\S+\.py):\d+\)?$")


def _check_of(frame: str) -> tuple[bool, str | None]:
    """(is the frame anchormesh's, the check it belongs to or None)."""
    m = OURS.search(frame)
    if not m:
        return False, None
    path, func = m.group(1), frame.split(" (")[0].strip()
    for name, module, not_checks in CHECKS:
        if path.endswith(module):
            return True, None if func in not_checks else name
    return True, None


def checks_breakdown(raw_files: list[Path]) -> dict:
    """On-CPU py-spy samples of these files that the checks took, per check and in all."""
    per, busy = collections.Counter(), 0
    for frames, n, waiting in samples(raw_files):
        if waiting:
            continue
        busy += n
        for fr in reversed(frames):
            ours, check = _check_of(fr)
            if ours:
                if check:
                    per[check] += n
                break
    total = sum(per.values())
    return {
        "on_cpu_samples": busy,
        "check_samples": total,
        "share_of_process_cpu": round(total / busy, 4) if busy else 0.0,
        "per_check": {k: round(v / busy, 4) for k, v in per.most_common()} if busy else {},
    }


def share_of_machine(breakdowns: dict[str, dict], cpu_share: dict[str, float]) -> float:
    """The checks' share of the machine: each process kind's CPU share of the machine times the
    share of its on-CPU samples the checks took (`breakdowns`: kind -> checks_breakdown)."""
    return round(sum(b["share_of_process_cpu"] * cpu_share.get(kind, 0.0) for kind, b in breakdowns.items()), 4)


def compare(runs: list[dict]) -> dict:
    """Medians of the TLS-on and TLS-off runs side by side (`runs`: run_profile results, each with
    `tls`), and their ratios: what TLS costs in tokens/s and in hivemind's share of the machine."""

    def med(tls: bool, key) -> float | None:
        vals = [key(r) for r in runs if r["tls"] == tls]
        return round(statistics.median(vals), 4) if vals else None

    def hivemind(r: dict) -> float:
        return sum(v for k, v in r["cpu_share_of_machine"].items() if k.startswith("hivemind"))

    def checks(r: dict) -> float:
        return r.get("checks_share_of_machine", 0.0)

    out = {}
    for label, key in (
        ("tokens_per_s", lambda r: r["tokens_per_s"]),
        ("hivemind_share", hivemind),
        ("checks_share", checks),
    ):
        on, off = med(True, key), med(False, key)
        out[label] = {"tls": on, "plaintext": off, "tls_over_plaintext": round(on / off, 3) if on and off else None}
    out["runs_each"] = {"tls": sum(r["tls"] for r in runs), "plaintext": sum(not r["tls"] for r in runs)}
    return out
