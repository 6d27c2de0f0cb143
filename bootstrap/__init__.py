"""anchormesh bootstrap node: first DHT node, tracker and status service (arrives with the swarm issue)."""

import peer  # noqa: F401,E402  (gRPC's fork handling is set there, before anything loads grpc)
