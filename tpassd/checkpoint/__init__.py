"""Snapshot and restore of a rank: CUDA checkpoint (cuda.py), CRIU (criu.py)
and the task wrapper that makes a rank dumpable (rankwrap.py).

Needs no torch: tpassd imports this on every node.
"""
