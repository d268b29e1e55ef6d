"""fleet audit: how often it names exactly the faulty node or rail, and how long it takes on 4 nodes.

    .venv/bin/python bench/bench_fleet_audit.py [--runs 5] [--subnet 10.79.0]
                                                [--out bench/results/fleet_audit.json]

One devcluster of its own (4 nodes, 2 data rails). Cases, each ``--runs`` times, the faulty node
(and rail) drawn at random per run (the seed is in the results):

* ``none`` (the baseline, once): no fault; the audit must name nothing;
* ``slow``: ``tpassctl devcluster slow NODE --cpu 5``; the audit must name NODE and nothing else;
* ``link``: ``tpassctl devcluster link NODE --rail R rate=100``; it must name (NODE, railR) only.

Per run: ``tpassctl fleet audit --json`` as root (without --drain), its wall time, what it named
and whether that is exactly the expected; the fault is lifted after each run. Writes the results
file; docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from torchpass.devcluster import Devcluster, DevclusterSpec  # noqa: E402

TPASSCTL = str(Path(sys.executable).parent / "tpassctl")


def log(msg: str) -> None:
    print(f"[bench_fleet_audit {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tpassctl(c: Devcluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    argv = [TPASSCTL, *args, "--name", c.spec.name] if args[0] == "devcluster" else [TPASSCTL, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **c.env()})


def check(p: subprocess.CompletedProcess) -> None:
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(p.args[:4])}: {p.stderr.strip()[-300:]}")


def one(c: Devcluster, case: str, rng: random.Random) -> dict:
    node = rng.choice(list(c.node_names))
    rail = rng.randrange(2)
    if case == "slow":
        check(tpassctl(c, "devcluster", "slow", node, "--cpu", "5"))
        expected = {"nodes": [node], "links": []}
    elif case == "link":
        check(tpassctl(c, "devcluster", "link", node, "--rail", str(rail), "rate=100"))
        expected = {"nodes": [], "links": [[node, f"rail{rail}"]]}
    else:
        expected = {"nodes": [], "links": []}
    t0 = time.monotonic()
    out = tpassctl(c, "fleet", "audit", "--json")
    took = time.monotonic() - t0
    try:
        res = json.loads(out.stdout)
        v = res["verdict"]
        named = {"nodes": sorted(v["nodes"]), "links": [[x["node"], x["rail"]] for x in v["links"]]}
    except (ValueError, KeyError, TypeError):
        res, named = {}, {"error": out.stderr[-500:]}
    if case == "slow":
        tpassctl(c, "devcluster", "slow", node, "--cpu", "clear")
    elif case == "link":
        tpassctl(c, "devcluster", "link", node, "--rail", str(rail), "clear")
    ok = named == expected
    log(f"{case}: {'exact' if ok else 'WRONG'} in {took:.1f} s; expected {expected}, named {named}")
    return {"case": case, "expected": expected, "named": named, "exact": ok, "seconds": round(took, 1),
            "audit_seconds": res.get("seconds"), "compute": {n: r.get("seconds") for n, r in
                                                             res.get("compute", {}).items()},
            "links": res.get("links")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--subnet", default="10.79.0")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "fleet_audit.json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    load = os.getloadavg()[0]
    c = Devcluster.up(DevclusterSpec(name="fbench", subnet=a.subnet, nodes=4, rails=2))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = []
    try:
        for case, n in (("none", 1), ("slow", a.runs), ("link", a.runs)):
            for _ in range(n):
                runs.append(one(c, case, rng))
    finally:
        c.down()
    summary = {}
    for case in ("none", "slow", "link"):
        rs = [r for r in runs if r["case"] == case]
        summary[case] = {"exact": sum(r["exact"] for r in rs), "of": len(rs),
                         "median_s": statistics.median(r["seconds"] for r in rs),
                         "max_s": max(r["seconds"] for r in rs)}
    result = {"started": started, "seed": a.seed, "load_average_at_start": round(load, 2),
              "load_average_at_end": round(os.getloadavg()[0], 2), "summary": summary, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for case, s in summary.items():
        print(f"{case}: {s['exact']} of {s['of']} exact; audit median {s['median_s']} s, max {s['max_s']} s")
    return 0 if all(s["exact"] == s["of"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
