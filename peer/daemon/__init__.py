"""The peer process (`anchormesh peer`): `PeerDaemon` in main.py, wired from small parts, each
with one job. Import the parts from their modules; this package file stays empty so that the
client side can import a part without starting the daemon's imports."""
