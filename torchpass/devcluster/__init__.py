"""A real Slurm cluster on one machine, for demos, development and tests.

munged and slurmctld run in the root network namespace on a bridge; every
node is a slurmd in its own network namespace (a veth to the bridge), its own
UTS namespace (its own hostname) and mount namespace (its own /etc/hosts),
with a tpassd beside it. Nothing is simulated: jobs run through the real
slurmctld/slurmd/slurmstepd, with the torchpass SPANK plugin loaded.

Everything the cluster starts or creates is recorded in ``cluster.json`` in
its run directory as it happens, so ``down`` removes it all even after a
crash; ``down`` also works from the names alone when that file is gone.
"""

from torchpass.devcluster.cluster import Devcluster, DevclusterSpec

__all__ = ["Devcluster", "DevclusterSpec"]
