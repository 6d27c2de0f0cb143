"""What a peer keeps on disk and hands out: shard checkpoints (checkpoint.py) and their transfer
in chunks over GetShard (shard.py)."""
