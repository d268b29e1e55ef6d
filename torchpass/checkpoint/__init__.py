"""The checkpoint mechanism: one home, one implementation.

* ``criu``: find CRIU, dump a quiesced rank (left running), restore it.
* ``cuda``: the driver's CUDA checkpoint API (GPU state to host memory and back).
* ``manifest``: a snapshot's manifest and its one checksum.
* ``rankwrap``: the task wrapper that makes a rank movable (``tpass-rankwrap``).
* ``restore_gate``: a restore step started before its snapshot exists waits here.
* ``service``: what tpassd's ``tpassd.snapshot`` / ``tpassd.restore`` requests do
  (dump, kill, abort, verify); tpassd/checkpoint_handlers.py registers them.
* ``procs``: which processes tpassd may act on (Slurm's list, owner, parent,
  namespaces; pinned by a pidfd), never the user's word for it.
* ``safeio``: root's reads and writes near user-writable directories (no
  symlink followed, capped reads of regular files only).

Paths come from torchpass.layout. Needs no torch: tpassd imports this on every node.
"""
