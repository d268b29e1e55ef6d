"""The audit's job-side program: run by the cluster's job Python inside an audit job step.

Standalone on purpose (the standard library, and torch when the job Python has it): the audit
runs it as ``python -c`` source after workload.py's, so nothing is installed on the nodes, and
tpassctl (which never loads torch) reads it as text, never imports it.

* ``compute``: a fixed workload (numpy, else torch, else pure Python), timed (the fastest of
  ``--repeats``: the others ran beside someone else's process), and its checksum, which the
  audit compares with ``expected_checksum``.
  C <- (C @ P) * 3 mod 65521, with C a fixed pseudo-random integer matrix and P a fixed
  permutation matrix: dense matmuls whose result has a closed form, every
  value an integer below 2**53 so float64 is exact whatever order the sums run in.
* ``links``: every pair of ranks in turn (one pair at a time, so pairs do not share a link),
  per data rail, on a gloo process group built on that rail's interface as training builds it
  (torchpass/runtime/pg.py): the fastest of ``--rounds`` ping-pongs of ``--bytes`` (bandwidth)
  and of 8 x ``--rounds`` of 4 bytes (latency), after one untimed round (a pair's first message
  pays for its connection: 2.7 ms against 0.27 ms after, measured on the devcluster).

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

if "expected_checksum" not in globals():  # run as -c source, workload.py's text comes first
    from torchpass.fleet.workload import MOD, SCALE, workload


def _compute_torch(n: int, iters: int, seed: int) -> tuple[float, int]:
    import torch
    torch.set_num_threads(1)
    c0, perm = workload(n, seed)
    c = torch.tensor(c0, dtype=torch.float64)
    p = torch.zeros((n, n), dtype=torch.float64)
    for j in range(n):
        p[perm[j], j] = 1.0
    t0 = time.perf_counter()
    for _ in range(iters):
        c = torch.remainder(c @ p * SCALE, MOD)
    took = time.perf_counter() - t0
    w = torch.tensor([[i + 2 * j + 1 for j in range(n)] for i in range(n)], dtype=torch.float64)
    total = int(sum(int(x) for x in (c * w).sum(dim=1).tolist()))
    return took, total % (1 << 61)


def _compute_numpy(n: int, iters: int, seed: int) -> tuple[float, int]:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread, as torch's
        os.environ[var] = "1"
    import numpy as np
    c0, perm = workload(n, seed)
    c = np.array(c0, dtype=np.float64)
    p = np.zeros((n, n), dtype=np.float64)
    p[perm, list(range(n))] = 1.0
    t0 = time.perf_counter()
    for _ in range(iters):
        c = np.remainder(c @ p * SCALE, MOD)
    took = time.perf_counter() - t0
    w = np.array([[i + 2 * j + 1 for j in range(n)] for i in range(n)], dtype=np.float64)
    total = sum(int(x) for x in (c * w).sum(axis=1).tolist())
    return took, total % (1 << 61)


def _compute_python(n: int, iters: int, seed: int) -> tuple[float, int]:
    c, perm = workload(n, seed)
    t0 = time.perf_counter()
    for _ in range(iters):
        c = [[sum(row[k] * (1 if perm[j] == k else 0) for k in range(n)) * SCALE % MOD for j in range(n)]
             for row in c]
    took = time.perf_counter() - t0
    total = sum((i + 2 * j + 1) * c[i][j] for i in range(n) for j in range(n))
    return took, total % (1 << 61)


ENGINES = ("numpy", "torch")


def compute(n: int, iters: int, repeats: int, seed: int = 1) -> dict:
    """numpy first: it loads in 0.1 s of CPU, torch in ~3 s, and a node under test may be the one
    starved of CPU (a node at 5 % of a CPU took 60 s to import torch); else torch, else pure Python
    on a smaller matrix (its time compares only with other pure-Python nodes)."""
    import importlib.util
    if importlib.util.find_spec("numpy") is not None:
        run, engine = _compute_numpy, "numpy"
    elif importlib.util.find_spec("torch") is not None:
        run, engine = _compute_torch, "torch"
    else:
        run, engine, n = _compute_python, "python", min(n, 48)
    times, checksums = [], set()
    for _ in range(repeats):
        took, total = run(n, iters, seed)
        times.append(took)
        checksums.add(total)
    return {"node": socket.gethostname().split(".")[0], "engine": engine, "n": n, "iters": iters,
            "seconds": min(times), "all_seconds": times, "checksum": checksums.pop() if len(checksums) == 1 else -1,
            "tools": tools()}


# Hardware checks run where their binary exists; "absent" says the node has none (not "healthy").
TOOLS = {"dcgmi": ["dcgmi", "diag", "-r", "1"], "ibstat": ["ibstat"], "nvlink": ["nvidia-smi", "nvlink", "-s"]}


def tools() -> dict:
    import shutil
    import subprocess
    out: dict = {}
    for name, argv in TOOLS.items():
        if shutil.which(argv[0]) is None:
            out[name] = "absent"
            continue
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            out[name] = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-2000:]}
        except (OSError, subprocess.TimeoutExpired) as exc:
            out[name] = {"rc": None, "tail": str(exc)}
    return out


def links(rails: list[str], master: str, port: int, nbytes: int, rounds: int, backend: str) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    store = dist.TCPStore(master, port, world, rank == 0, timeout=timedelta(seconds=120))
    node = socket.gethostname().split(".")[0]
    store.set(f"node{rank}", node)
    nodes = [store.get(f"node{r}").decode() for r in range(world)]
    big, small = torch.ones(nbytes // 4, dtype=torch.float32), torch.ones(1, dtype=torch.float32)
    out: dict = {"nodes": nodes, "rails": {}}
    for rail in rails:
        if backend != "gloo":
            raise SystemExit(f"backend {backend}: only gloo is built here (NCCL: the same pairs on GPU tensors)")
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=120)
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=rail)]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"audit/{rail}/", store), rank, world, opts)
        pairs = []
        for a in range(world):
            for b in range(a + 1, world):
                if rank in (a, b):
                    peer = b if rank == a else a
                    bw, lat = [], []
                    # one untimed round first: a pair's first message pays for its connection
                    plan = [(small, None), (big, None)] + [(small, lat)] * (rounds * 8) + [(big, bw)] * rounds
                    for buf, into in plan:
                        t0 = time.perf_counter()
                        if rank == a:
                            pg.send([buf], peer, 0).wait()
                            pg.recv([buf], peer, 0).wait()
                        else:
                            pg.recv([buf], peer, 0).wait()
                            pg.send([buf], peer, 0).wait()
                        if into is not None:
                            into.append(time.perf_counter() - t0)
                    if rank == a:
                        pairs.append({"a": nodes[a], "b": nodes[b], "bandwidth_bps": 2 * nbytes * 8 / min(bw),
                                      "latency_s": min(lat) / 2})
                pg.barrier().wait()  # one pair at a time: the next starts when this one is done
        out["rails"][rail] = pairs
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compute")
    c.add_argument("--n", type=int, default=256)
    c.add_argument("--iters", type=int, default=40)
    c.add_argument("--repeats", type=int, default=3)
    s = sub.add_parser("links")
    s.add_argument("--rails", required=True)
    s.add_argument("--master", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--bytes", type=int, default=4 << 20)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--backend", default="gloo")
    a = ap.parse_args()
    if a.what == "compute":
        print(json.dumps(compute(a.n, a.iters, a.repeats)), flush=True)
    else:
        print(json.dumps(links(a.rails.split(","), a.master, a.port, a.bytes, a.rounds, a.backend)), flush=True)


if __name__ == "__main__":
    main()
