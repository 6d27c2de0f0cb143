"""The client side: tools that talk to a running swarm and hold no state of it: `status` (status.py,
the JSON view in view.py), the live dashboard (dashboard.py, its problem rules in problems.py),
`health`, `ban` and `export`. Nothing in the daemon or the tracker imports this package, except
the tracker's /metrics endpoint, which serves the same JSON view."""
