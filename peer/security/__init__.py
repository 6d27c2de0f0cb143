"""Who may do what: identity keys and certificates (identity.py, tls.py), the gRPC gate (auth.py,
call_check.py), the DHT's token authorizer (dht_auth.py) and the signed tracker records
(tracker_record.py). Used by peer, bootstrap and client."""
