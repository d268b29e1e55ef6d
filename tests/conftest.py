"""Settings for the whole test suite: strict transitions, and the three tiers.

Every test belongs to one tier, by what it needs (support/tiers.py says which unit file is
which):

- ``pure``: Python in this process only. No root, CRIU, munged, Slurm, and no child process
  of torch or of those programs. ``make test-fast`` runs these, 60 s each at most.
- ``host``: this machine as root: CRIU, a private munged, tpass-init, rank processes that load
  torch, cgroups.
- ``cluster``: a devcluster (tests/integration): real Slurm in network namespaces.

A test marked pure that asks for a host fixture, or starts a host program, fails at once with
a line saying which: the fast tier stays fast and runs on any machine.
"""

import os
import subprocess

import pytest

from support import cluster_order, tiers

# An illegal phase transition in the coordinator's core raises instead of rolling back
# (torchpass/coordinator/phases.py). Set in the environment, so the coordinators that the
# integration tests' jobs start (sbatch exports it) are strict too.
os.environ["TORCHPASS_STRICT_TRANSITIONS"] = "1"


def pytest_configure(config):
    for tier, what in tiers.TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tiers.tier_of(item)
        item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(tiers.TIMEOUT_S[tier]))
    cluster_order.longest_modules_first(items)


# Wall seconds per cluster module and per devcluster worker, summed from the test reports, for
# cluster_order.MODULE_SECONDS and to see how evenly the two devclusters were loaded.
_module_wall_s: dict[tuple[str, str], float] = {}


def pytest_runtest_logreport(report):
    if "tests/integration/" not in report.nodeid:
        return
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    module = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    _module_wall_s[(worker, module)] = _module_wall_s.get((worker, module), 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _module_wall_s:
        return
    terminalreporter.write_sep("-", "cluster modules by wall time")
    for (worker, module), seconds in sorted(_module_wall_s.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s {worker} {module}")
    per_worker: dict[str, float] = {}
    for (worker, _module), seconds in _module_wall_s.items():
        per_worker[worker] = per_worker.get(worker, 0.0) + seconds
    terminalreporter.write_line("per worker: " + ", ".join(f"{w} {s:.0f}s" for w, s in sorted(per_worker.items())))


@pytest.fixture(autouse=True)
def _pure_stays_pure(request, monkeypatch):
    """A pure test that asks for a host fixture, or starts a host program, fails naming it."""
    if request.node.get_closest_marker("pure") is None:
        yield
        return
    used = sorted(set(request.fixturenames) & tiers.HOST_FIXTURES)
    if used:
        pytest.fail(f"{request.node.nodeid} is in the pure tier but uses the host fixture(s) {used}: "
                    f"list its file in tests/support/tiers.py HOST_MODULES", pytrace=False)
    real_init = subprocess.Popen.__init__

    def checked_init(self, args, *a, **kw):
        program = tiers.host_program(args, kw.get("executable"))
        if program:
            pytest.fail(f"{request.node.nodeid} is in the pure tier but starts {program!r}: "
                        f"list its file in tests/support/tiers.py HOST_MODULES", pytrace=False)
        real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_init)
    yield
