"""anchormesh bootstrap node: first DHT node, tracker and status service (arrives with the swarm issue)."""
