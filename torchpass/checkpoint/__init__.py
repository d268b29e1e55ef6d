"""The checkpoint mechanism: one home, one implementation.

For training code: ``torchpass.checkpoint.Checkpointer`` (application.py),
asynchronous application checkpoints in the torch.distributed.checkpoint
format. It is loaded on first use, with torch; everything else here needs no
torch.

For torchpass itself (process images, CRIU):

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

# The training API (application.py) imports torch: loaded only when training code asks for it,
# so that tpassd, which imports the modules above, never loads torch.
_APPLICATION_API = frozenset({"Checkpointer", "CheckpointError", "ModelState", "Saved", "complete_checkpoints"})


def __getattr__(name: str):
    if name in _APPLICATION_API:
        from torchpass.checkpoint import application

        return getattr(application, name)
    raise AttributeError(f"module 'torchpass.checkpoint' has no attribute {name!r}")
