"""Who may do what: identity keys and certificates (identity.py, tls.py), the gRPC gate (auth.py)
and the DHT's token authorizer and signed records (dht_auth.py). Used by peer, bootstrap and client."""
