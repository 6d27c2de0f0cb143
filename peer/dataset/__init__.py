"""Training data prepared once, by the operator: `prepare.py` writes token shards and a manifest
(`manifest.py`) from a text file, a folder or a Hugging Face dataset (`sources.py`); `shards.py`
checks a prepared folder and reads training windows by id and the fixed eval windows.

The swarm does not read prepared folders yet: stage-0 peers still build their data with
`peer/data.py`.
"""
