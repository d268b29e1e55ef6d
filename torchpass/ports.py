"""tpassd's TCP ports: the one definition in Python.

tpassd binds them by default (tpassd/config.py); the coordinator subscribes
to and calls every node's tpassd on them; tpassctl and the devcluster use them
for nodes found in Slurm.

All three are below 1024: only root (CAP_NET_BIND_SERVICE) may bind them, so
while tpassd restarts no user can listen on its port and answer the
coordinators, or take the scrape, in its place. Before, they were
7717, 7718 and 9818 (docs/admin.md, "Ports and firewall", has the upgrade
note). Each stays configurable (tpassd.toml pub_port, control_port,
metrics_port; torchpass/tpassd_ports.py).
"""

TPASSD_PUB_PORT = 717  # ZeroMQ PUB: health samples, events, heartbeats
TPASSD_CONTROL_PORT = 718  # ZeroMQ ROUTER: health snapshot, drills, snapshot/restore requests
TPASSD_METRICS_PORT = 918  # Prometheus text exposition over HTTP
