"""The `[security]` section: who may call what, and the limits on what callers send."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import positive


@dataclass
class SecurityConfig:
    """Who may call what (peer/security/auth.py); joining always needs the run token.

    Args:
        private_status: the Status service (the dashboard) wants the run token too; by default
            anyone who can reach the tracker may watch the run.
        tls: gRPC over TLS: the bootstrap makes a run CA, certifies itself and every peer that
            joins; peers need the CA (`--tls-ca`, the bootstrap.json's "tls_ca").
        calls_per_s: new gRPC calls per second one caller may open (bursts of 10 s worth).
        messages_per_s: stream messages per second one peer may send to a stage server (bursts of
            10 s worth); a normal peer sends a few per micro-batch.
        receive_deadline_s: seconds a call's request may take to arrive after its headers; a call
            that sends headers and no request is cancelled then (peer/security/admission.py).
        open_calls_per_host: concurrent anonymous calls (the public status) the tracker takes
            from one host; a dashboard holds one.
        link_rms_factor: an activation or gradient whose RMS exceeds this many times the running
            RMS of its link (after a warm-up of a few messages) is refused and counted against
            its sender (peer/pipeline/bounds.py); honest gradients grew 21x within a few steps
            early in a swarm test, and a sender refused 8 times in a row has its new level taken.
        max_link_value: the largest magnitude a gradient crossing a stage link may have, from any
            sender at any time (honest gradients of hidden states stay far below 1).
        max_activation_value: the largest magnitude an activation crossing a stage link may have.
            Far above max_link_value on purpose: nothing in the loss holds a stage output's scale
            (the next stage normalises it), so honest hidden states can keep growing, and a cap
            they reach stops the run; below ~1e17 the receiver's float32 arithmetic stays finite.
    """

    private_status: bool = False
    tls: bool = False
    calls_per_s: float = 20.0
    messages_per_s: float = 200.0
    receive_deadline_s: float = 10.0
    open_calls_per_host: int = 8
    link_rms_factor: float = 64.0
    max_link_value: float = 1e6
    max_activation_value: float = 1e15

    def __post_init__(self) -> None:
        positive("security.calls_per_s", self.calls_per_s)
        positive("security.messages_per_s", self.messages_per_s)
        positive("security.receive_deadline_s", self.receive_deadline_s)
        positive("security.open_calls_per_host", self.open_calls_per_host)
        positive("security.link_rms_factor", self.link_rms_factor)
        positive("security.max_link_value", self.max_link_value)
        positive("security.max_activation_value", self.max_activation_value)
