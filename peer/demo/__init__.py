"""`anchormesh demo`: a local swarm of processes (swarm.py) or the training core alone in one
process (local.py)."""
