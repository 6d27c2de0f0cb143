"""`anchormesh doctor`: a volunteer's machine checked before it joins a run, one line per check.

Why a package of its own and not peer/client/: the memory check reuses the daemon's memory plan
(peer/daemon/memory.py), and the client side stays a leaf that never imports the daemon
(tests/test_layout.py). `checks.py` judges each check from plain inputs (tests feed it fakes);
`run.py` gathers the inputs from this machine and the tracker, prints and sets the exit code.
"""
