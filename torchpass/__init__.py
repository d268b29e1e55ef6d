"""torchpass: workload fault tolerance for distributed PyTorch training on Slurm.

The base package holds what every component shares: the exception hierarchy,
logging set-up, the one wire schema, the ZeroMQ helpers and typed configs.
It must never import torch (tpassd and tpassctl run without it).
"""

__version__ = "0.1.0"
