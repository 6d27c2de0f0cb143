"""`anchormesh bootstrap`: the first hivemind DHT node plus the tracker and status gRPC services.

It publishes the tracker's address in the DHT (key `anchormesh/tracker`, signed with the
tracker's Ed25519 key: peer/security/tracker_record.py), so a peer given only `--initial-peers` finds it, and
writes `STATE_DIR/bootstrap.json` = `{"run_id", "dht_maddrs", "tracker", "tracker_key", "token",
"operator"[, "tls_ca"]}` (mode 0600: it holds the run's secrets) once it accepts peers; stdout
gets the same without the secrets. Its DHT node admits only run-token holders (`RunAuthorizer`)
and stores only tracker records its own key signed.

Every call is checked by a `Gate` (peer/security/auth.py): Join takes the run token, Heartbeat and Leave a
member certificate (issued at Join), Ban the operator key, Status the token too when the run is
private. A run off loopback (peer/security/exposure.py) serves TLS and a private status unless
the operator opts out by name (`--insecure-plaintext`, `--public-status`; the `security` settings
ask for them on loopback too); bootstrap.json's "address" (`HOST:PORT#KEY`) carries the tracker key.

This module wires the process together (DHT, state, data, server); the calls themselves are in
bootstrap/services.py and the server, its TLS and its gate in bootstrap/server.py.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import uuid
from dataclasses import asdict, replace
from pathlib import Path

from bootstrap import keys, persist
from bootstrap.prepare import prepare_run
from bootstrap.run_data import DataFiles, data_order, drop_prepared, open_run_data
from bootstrap.server import serve_tracker
from bootstrap.tracker import Tracker
from peer.address import announce_maddr, free_port
from peer.atomic import write_atomic
from peer.config import TrainConfig
from peer.dataset.hub import HubData, is_hub
from peer.dataset.shards import PreparedData
from peer.errors import ConfigError
from peer.logs import setup_logging
from peer.model.loading import resolve_dims
from peer.runtoml import config_digest, config_from_dict, resolve_run
from peer.security import dht_auth, tracker_record
from peer.security.exposure import address_line, exposed

log = logging.getLogger("anchormesh.bootstrap")
DHT_TRACKER_KEY = tracker_record.TRACKER_RECORD_KEY
DHT_TTL_S = 60.0


def default_run() -> TrainConfig:
    """The run of a bootstrap started without --config: the recommended run on the tiny model
    (its departures are `TINY_RUN` in peer/config/recommended.py), 2 stages."""
    return resolve_run().config


def run_protection(
    config: TrainConfig, host: str, announce_host: str | None, insecure_plaintext: bool, public_status: bool
) -> tuple[bool, bool]:
    """(TLS, private status) of a run: on when the config asks, or when an address is off
    loopback and the operator did not opt out; an opt-out against the config's ask is refused."""
    if insecure_plaintext and config.security.tls:
        raise ConfigError("--insecure-plaintext", True, "the run config sets security.tls = true")
    if public_status and config.security.private_status:
        raise ConfigError("--public-status", True, "the run config sets security.private_status = true")
    off_loopback = exposed([host, announce_host])
    tls = config.security.tls or (off_loopback and not insecure_plaintext)
    if off_loopback and not tls:
        log.warning(
            "UNSAFE: --insecure-plaintext on %s: activations, gradients and token ids cross the network in the clear",
            announce_host or host,
        )
    return tls, config.security.private_status or (off_loopback and not public_status)


def attach_data(tracker: Tracker, data) -> None:
    """The run's prepared data on the tracker: a new run's order, or the saved one checked against the data."""
    order, tracker.eval_windows = data_order(data, tracker.config)
    if tracker.data is None:
        tracker.data = order
    elif tracker.data.windows != order.windows:
        raise ConfigError(
            "data",
            str(data.folder),
            f"holds {order.windows} training windows; the saved run's order covers {tracker.data.windows}: the data changed under the run (pass --new-run)",
        )
    tracker.data.budget = order.budget  # the run.toml's budget, also for a resumed order
    tracker.data_manifest = data.manifest.to_json().decode()
    tracker.data_hub = data.hub if isinstance(data, HubData) else ""
    log.info(
        "data: %s, %d training windows of %d tokens, epoch %d at window %d; %d eval windows",
        data.manifest.source,
        order.windows,
        order.seq_len,
        tracker.data.epoch,
        tracker.data.cursor,
        tracker.eval_windows,
    )


def run_bootstrap(
    config: TrainConfig | None,
    host: str,
    port: int,
    dht_port: int,
    state_dir: Path,
    peer_timeout_s: float = 10.0,
    metrics_port: int | None = None,
    announce_host: str | None = None,
    new_run: bool = False,
    token: str | None = None,
    insecure_plaintext: bool = False,
    public_status: bool = False,
    dial_back: bool = True,
) -> None:
    """Run until SIGTERM/SIGINT. With `announce_host`, the published tracker address and the DHT's
        multiaddrs name that host instead of the bound one (needed behind 0.0.0.0: peers elsewhere
        cannot dial 0.0.0.0, and hivemind would list the container's own addresses). `token` sets
        the run token (default: the stored one, or a new random one). Off loopback the run uses TLS
        and a private status unless `insecure_plaintext` / `public_status` say otherwise. `dial_back`
    (default on; `--no-dial-back` turns it off): Join refuses a peer whose announced addresses do
    not answer (bootstrap/dial_back.py)."""
    import hivemind

    setup_logging()
    saved = None if new_run else persist.load(state_dir)
    if saved is not None:  # a restart: the same run, unless the operator asks for another config
        if config is not None and asdict(replace(config, model=resolve_dims(config.model))) != saved["config"]:
            raise ConfigError(
                "--config",
                "run.toml",
                f"{state_dir} holds run {saved['run_id']} with another config; pass --new-run to start a new run there, or use another --state-dir",
            )
        config = config_from_dict(saved["config"])
        port = port or saved.get("ports", {}).get("tracker", 0)  # the same address, so peers reconnect
        dht_port = dht_port or saved.get("ports", {}).get("dht", 0)
    config = prepare_run(
        config or default_run()
    )  # before anything starts: a bad config fails here, not after the DHT is up
    state_dir.mkdir(parents=True, exist_ok=True)
    if saved is None:
        keys.forget(state_dir)  # a new run: the old run's certificates must not admit anyone
        if not config.data.prepared or is_hub(
            config.data.prepared
        ):  # ... and the data it prepared or pinned may be another config's (an operator's folder is never touched)
            drop_prepared(state_dir)
    data = open_run_data(config, state_dir)  # before the DHT: preparing may take a while, and a bad source fails here
    secrets = keys.load_or_create(state_dir, token)
    tls, private = run_protection(config, host, announce_host, insecure_plaintext, public_status)
    ca = None
    if tls:
        from peer.security.tls import RunCA

        ca = RunCA.load_or_create(state_dir)
    announce = None
    if announce_host or saved is not None:
        dht_port = dht_port or free_port(host)  # hivemind needs the announced port up front; a run keeps its port
    if announce_host:
        announce = [announce_maddr(announce_host, dht_port)]
    # a persistent identity: the DHT's /p2p/ id (in every peer's --initial-peers) survives a restart;
    # only run-token holders take part, and only this tracker's signed record lands under its key
    dht = hivemind.DHT(
        host_maddrs=[f"/ip4/{host}/tcp/{dht_port}"],
        announce_maddrs=announce,
        identity_path=str(state_dir / "dht.key"),
        start=True,
        **dht_auth.dht_kwargs(secrets.token, secrets.tracker.public),
    )
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    if saved is not None:
        tracker = persist.restore(saved, peer_timeout_s=peer_timeout_s, dht_maddrs=maddrs)
    else:
        tracker = Tracker(f"run-{uuid.uuid4().hex[:8]}", config, peer_timeout_s=peer_timeout_s, dht_maddrs=maddrs)
    attach_data(tracker, data)
    run_id = tracker.run_id
    ports: dict[str, int] = {}
    saver = persist.StateSaver(tracker, state_dir, ports)
    files = DataFiles(data) if isinstance(data, PreparedData) else None  # data on the hub: peers download it there
    server, address = serve_tracker(
        tracker, host, port, secrets, ca, files, saver.commit, private_status=private, dial_back=dial_back
    )
    ports |= {
        "tracker": int(address.rsplit(":", 1)[1]),
        "dht": int(maddrs[0].split("/tcp/")[1].split("/")[0]) if maddrs else dht_port,
    }
    if announce_host:
        address = f"{announce_host}:{address.rsplit(':', 1)[1]}"
    metrics = None
    if metrics_port is not None:
        from peer.client.view import status_dict
        from peer.metrics import serve_metrics

        metrics = serve_metrics(metrics_port, lambda: status_dict(tracker.status()), host=host)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics.server_address[1])
    stop = threading.Event()

    def publish() -> None:  # signed: peers take only a record of this tracker's key (peer/security/tracker_record.py)
        while not stop.is_set():
            tracker_record.publish_tracker(dht, secrets.tracker, run_id, address, DHT_TTL_S)
            stop.wait(DHT_TTL_S / 3)

    threading.Thread(target=publish, name="dht-publish", daemon=True).start()

    def keep_state() -> None:  # the run state on disk, so a killed bootstrap resumes it
        while not stop.wait(persist.SAVE_EVERY_S):
            try:
                saver.save()
            except OSError as exc:
                log.error("cannot save the tracker state in %s: %s", state_dir, exc)

    saver.save()
    threading.Thread(target=keep_state, name="tracker-state", daemon=True).start()
    # public: the address line carries the tracker key, which checks its DHT record and its TLS CA
    info = {
        "run_id": run_id,
        "dht_maddrs": maddrs,
        "tracker": address,
        "tracker_key": secrets.tracker.public.hex(),
        "address": address_line(address, secrets.tracker.public),
    }
    if ca is not None:
        info["tls_ca"] = ca.pem.decode()
    write_atomic(
        state_dir / "bootstrap.json",
        json.dumps({**info, "token": secrets.token, "operator": secrets.operator}).encode(),
        mode=0o600,
    )
    print(
        json.dumps({k: v for k, v in info.items() if k != "tls_ca"}), flush=True
    )  # no secrets on stdout: logs get shared
    log.info(
        "tracker for %s on %s%s, status %s; DHT %s; the run token is in %s",
        run_id,
        address,
        " (TLS)" if ca else " (plaintext)",
        "private" if private else "public",
        maddrs[0] if maddrs else "?",
        state_dir / "bootstrap.json",
    )
    log.info("volunteers join with --tracker %s and the run token", info["address"])
    log.info(
        "run config %s (model %s, %d stages, codec %s): `anchormesh config show` prints a run.toml's settings",
        config_digest(tracker.config),
        tracker.config.model.name,
        tracker.config.model.num_stages,
        tracker.config.mask.scheme,
    )
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    saver.save()
    server.stop(grace=1).wait()
    if metrics is not None:
        metrics.shutdown()
        metrics.server_close()
    dht.shutdown()
