"""CPU cost of authenticating one DHT request: hivemind's RSA-2048 scheme against our Ed25519 one.

Why: every DHT request and response is signed and checked (peer/security/dht_auth.py); with
hivemind's `TokenAuthorizerBase` that is an RSA-2048 PSS signature each, one of the main CPU
costs of hivemind's DHT process. Two views, side by side in one run, medians of
per-operation thread CPU time:

- **primitives**: sign and verify (the verifier parsing the signer's public key, as the
  authorizers do per request) the same serialized `StoreRequest` of a few hundred bytes, with
  hivemind's `RSAPrivateKey.sign`/`RSAPublicKey.verify` and with Ed25519 (`Identity.sign`, `verify`).
- **authorizers**: a whole `sign_request` + `validate_request` (access-token HMAC check,
  serialization, nonce memory) and a whole RPC (also `sign_response` + `validate_response`), for
  hivemind's `TokenAuthorizerBase` with our access tokens (the scheme before) and `RunAuthorizer`.

Run: `python -m peer.bench.dht_auth_cost [--reps N]`; prints JSON.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from peer.security.dht_auth import ACCESS_TTL_S, USERNAME, RunAuthorizer, _expiry, _token_bytes, dht_key
from peer.security.identity import Identity, verify

TOKEN = "bench-run-token-0123456789abcdef"


class RsaRunAuthorizer(TokenAuthorizerBase):
    """The scheme before: hivemind's RSA request/response signatures, with the run's access tokens
    (the same HMAC under `dht_key(token)`, naming the node's RSA key)."""

    def __init__(self, token: str) -> None:
        super().__init__(RSAPrivateKey())
        self._key = dht_key(token)

    def _hmac(self, t: AccessToken) -> bytes:
        return hmac.new(self._key, _token_bytes(t), hashlib.sha256).digest()

    async def get_token(self) -> AccessToken:
        expires = datetime.datetime.fromtimestamp(time.time() + ACCESS_TTL_S, datetime.timezone.utc).isoformat()
        t = AccessToken(username=USERNAME, public_key=self.local_public_key.to_bytes(), expiration_time=expires)
        t.signature = self._hmac(t)
        return t

    def is_token_valid(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        return (
            access_token.username == USERNAME
            and expires is not None
            and expires > time.time()
            and hmac.compare_digest(access_token.signature, self._hmac(access_token))
        )

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        return expires is None or expires - time.time() < ACCESS_TTL_S / 4


def typical_request() -> dht_pb2.StoreRequest:
    """A store of two keys, as a DHT node sends them (node id, subkeys, values, expiries), unsigned."""
    now = time.time()
    return dht_pb2.StoreRequest(
        keys=[bytes(range(20)), bytes(range(20, 40))],
        subkeys=[b"\xc0", b"\xa4peer"],
        values=[b"\x82\xa7address\xb3/ip4/10.0.0.2/tcp/7001\xa5stage\x01", b"\x93\x01\x02\x03"],
        expiration_time=[now + 60, now + 60],
        in_cache=[False, False],
        peer=dht_pb2.NodeInfo(node_id=bytes(range(7, 27))),
    )


def _drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the authorizers' methods, once their token is minted)
    without an event loop, so that the loop's own cost is not measured."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the coroutine suspended")


def _median_us(op: Callable[[], object], reps: int) -> float:
    op()  # warm up
    samples = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        op()
        samples.append(time.thread_time_ns() - t0)
    return statistics.median(samples) / 1e3


def primitives(reps: int) -> dict:
    """Sign and verify the same serialized request with RSA-2048 (hivemind) and Ed25519."""
    rsa, ed = RSAPrivateKey(), Identity.generate()
    auth = RunAuthorizer(TOKEN)
    req = typical_request()
    _drive(auth.sign_request(req, None))
    req.auth.signature = b""
    data = req.SerializeToString()  # what a node signs: the request, its auth filled, signature empty
    rsa_pub, rsa_sig, ed_sig = rsa.get_public_key().to_bytes(), rsa.sign(data), ed.sign(data)
    assert RSAPublicKey.from_bytes(rsa_pub).verify(data, rsa_sig) and verify(ed.public, ed_sig, data)
    out = {"request_bytes": len(data)}
    for name, sign, check in (
        ("rsa2048_pss", lambda: rsa.sign(data), lambda: RSAPublicKey.from_bytes(rsa_pub).verify(data, rsa_sig)),
        ("ed25519", lambda: ed.sign(data), lambda: verify(ed.public, ed_sig, data)),
    ):
        s, v = _median_us(sign, reps), _median_us(check, reps)
        out[name] = {"sign_us": round(s, 1), "verify_us": round(v, 1), "sign_plus_verify_us": round(s + v, 1)}
    out["ratio_rsa_over_ed25519"] = round(
        out["rsa2048_pss"]["sign_plus_verify_us"] / out["ed25519"]["sign_plus_verify_us"], 1
    )
    return out


def authorizers(reps: int) -> dict:
    """Whole sign_request + validate_request (and a whole RPC with the response) per scheme."""
    out: dict[str, Any] = {}
    for name, client, servicer in (
        ("hivemind_rsa", RsaRunAuthorizer(TOKEN), RsaRunAuthorizer(TOKEN)),
        ("run_ed25519", RunAuthorizer(TOKEN), RunAuthorizer(TOKEN)),
    ):
        last: dict[str, dht_pb2.StoreRequest] = {}

        def request() -> None:
            req = typical_request()
            _drive(client.sign_request(req, None))
            assert _drive(servicer.validate_request(req))
            last["req"] = req

        def rpc() -> None:
            request()
            resp = dht_pb2.StoreResponse(store_ok=[True, True], peer=dht_pb2.NodeInfo(node_id=bytes(20)))
            _drive(servicer.sign_response(resp, last["req"]))
            assert _drive(client.validate_response(resp, last["req"]))

        req = typical_request()
        _drive(client.sign_request(req, None))
        out[name] = {
            "signed_request_bytes": len(req.SerializeToString()),
            "request_us": round(_median_us(request, reps), 1),
            "rpc_us": round(_median_us(rpc, reps), 1),
        }
    out["ratio_request"] = round(out["hivemind_rsa"]["request_us"] / out["run_ed25519"]["request_us"], 1)
    out["ratio_rpc"] = round(out["hivemind_rsa"]["rpc_us"] / out["run_ed25519"]["rpc_us"], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.bench.dht_auth_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=400, help="operations timed per figure (median taken)")
    args = parser.parse_args(argv)
    result = {
        "reps": args.reps,
        "unit": "microseconds of thread CPU time, median",
        "primitives": primitives(args.reps),
        "authorizers": authorizers(args.reps),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
