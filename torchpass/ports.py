"""tpassd's TCP ports: the one definition in Python.

tpassd binds them by default (tpassd/config.py); the coordinator subscribes
to and calls every node's tpassd on them; tpassctl and the devcluster use them
for nodes found in Slurm.
"""

TPASSD_PUB_PORT = 7717  # ZeroMQ PUB: health samples, events, heartbeats
TPASSD_CONTROL_PORT = 7718  # ZeroMQ ROUTER: health snapshot, drills, snapshot/restore requests
TPASSD_METRICS_PORT = 9818  # Prometheus text exposition over HTTP
