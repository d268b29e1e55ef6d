"""Fault-drill kinds: the one definition, shared by tpassd (which runs drills,
tpassd/drills.py) and tpassctl (`tpassctl inject --fault`)."""

GPU_KINDS = ("xid79", "xid48", "ecc-sbe-storm", "row-remap-pending", "nvlink-crc", "nvml-error")
IB_KINDS = ("ib-link-down", "ib-link-flap")
CHECKPOINT_KINDS = ("restore-fail", "kill-fail")
KINDS = GPU_KINDS + IB_KINDS + CHECKPOINT_KINDS + ("clear",)
# Kinds only root may run: they damage a job's data, not just a health reading.
ROOT_KINDS = CHECKPOINT_KINDS
