"""`python -m peer.cli`: the same entry point as the `anchormesh` console script."""

from peer.cli import main

main()
