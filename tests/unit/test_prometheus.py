"""tpassd's real /metrics, scraped over HTTP from an in-process tpassd (fake NVML, fixture IB
tree, private munged, a fake Slurm), with a job family fed the way a coordinator feeds it: a
JobMetrics report from a job's event log, sent as a munge-authenticated tpassd.job_metrics
request. promtool checks the text; the dashboard's and the alert rules' metric names must be in it."""

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from support.fake_slurm import FakeSlurm
from torchpass import auth, zmqio
from torchpass.coordinator.job_metrics import JobMetrics
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.model import CoordState, RankView
from torchpass.errors import RemoteError
from tpassd.daemon import Tpassd
from tpassd.testing import call, credential_as, fake_node_config, wait_for

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "contrib" / "grafana" / "torchpass.json"
RULES = REPO / "contrib" / "prometheus" / "torchpass.rules.yml"
OWNER = 1001
# Names tpassd served before prometheus_client (docs/tpassd.md, "Renamed metrics").
OLD_NAMES = ("tpassd_gpu_utilization_percent", "tpassd_gpu_clock_throttle_reasons",
             "tpassd_infiniband_rate_gigabits_per_second", "tpassd_published_sample_total")


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: apt-get install -t trixie promtool (scripts/install-system-deps.sh does)"
    return path


def check_metrics(text: str) -> None:
    out = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def sample_names(text: str) -> set[str]:
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in text.splitlines()
            if line and not line.startswith("#")}


def expr_names(exprs: list[str]) -> set[str]:
    """The metric names in PromQL expressions: torchpass's own families and the process ones."""
    return {n for e in exprs for n in re.findall(r"\b(?:tpassd|process)_[a-zA-Z0-9_]+\b", e)}


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in d["templating"]["list"] if "definition" in v]
    return exprs


def coordinator_report(job_id: int, now: float) -> dict:
    """A report as the coordinator builds it: from the event log of a job whose first migration
    completed after 0.6 s paused, second one rolled back after 2.1 s, and whose snapshot completed."""
    job = JobState(job_id=job_id)
    job.record(0, "migration.started", "m1", migration="m1", node="n3")
    job.record(1, "migration.completed", "m1", migration="m1", node="n3", target="n7", outcome="completed",
               phase_durations={"paused": 0.6, "total": 9.0})
    job.record(2, "migration.rolled_back", "m2", migration="m2", node="n5", target="n8", outcome="rolled_back",
               phase_durations={"paused": 2.1, "total": 20.0})
    job.record(3, "snapshot.completed", "s1", snapshot="s1", step=40, pause_s=0.4, phase_durations={})
    ranks = {r: RankView(rank=r, node="n1", pid=100 + r, last_report=now - r) for r in range(4)}
    st = CoordState(job_id=job_id, world_size=8, ranks=ranks)
    m = JobMetrics()
    m.observe(job.events)
    return m.report(job_id, st, now, 15.0).to_body()


@pytest.fixture
def tpassd(tmp_path, munge, request):
    fake = FakeSlurm()
    fake.run_job(42, uid=OWNER, nodes=("node1",))
    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15),
               job_owner_uids=lambda: {OWNER}, slurm_client=fake, admin_uids=lambda: frozenset({0}),
               jobs_private=lambda: request.param)
    d.start()
    p = d.ports()
    d.ctl, d.url = f"tcp://127.0.0.1:{p['control_port']}", f"http://127.0.0.1:{p['metrics_port']}/metrics"
    assert wait_for(lambda: d.ticks >= 2)
    yield d
    d.stop()


def push_as_owner(d, body: dict, munge, uid: int = OWNER) -> dict:
    cred = credential_as(uid, uid, auth.request_digest("tpassd.job_metrics", body, "node1"), munge.socket)
    return zmqio.request(d.ctl, "tpassd.job_metrics", body, auth=cred, timeout_s=5, retries=0)


def scrape(d) -> str:
    return urllib.request.urlopen(d.url, timeout=5).read().decode()


@pytest.mark.parametrize("tpassd", [False], indirect=True)
def test_real_metrics_pass_promtool_and_hold_every_name_the_dashboard_and_rules_use(tpassd, munge):

    body = coordinator_report(42, time.monotonic())
    assert push_as_owner(tpassd, body, munge) == {"node": "node1", "jobs": 1}
    # an Xid: its family exists once one was seen (the dashboard graphs it)
    call(tpassd.ctl, "node1", "tpassd.drill", {"kind": "xid79", "gpu": 1}, munge.socket)
    assert wait_for(lambda: tpassd.xid_counts)
    text = scrape(tpassd)
    check_metrics(text)
    names = sample_names(text)
    assert 'tpassd_job_migrations_total{job_id="42",outcome="completed"} 1.0' in text
    assert 'tpassd_job_migrations_total{job_id="42",outcome="rolled_back"} 1.0' in text
    assert 'tpassd_job_snapshots_total{job_id="42",outcome="completed"} 1.0' in text
    assert 'tpassd_job_pause_seconds_bucket{job_id="42",kind="migration",le="1.0"} 1.0' in text
    assert 'tpassd_job_pause_seconds_count{job_id="42",kind="migration"} 2.0' in text
    assert 'tpassd_job_ranks_registered{job_id="42"} 4.0' in text
    assert 'tpassd_job_ranks_expected{job_id="42"} 8.0' in text
    assert 'tpassd_job_unprotected{job_id="42"} 0.0' in text
    assert {"tpassd_build_info", "tpassd_node_info", "process_cpu_seconds_total",
            "tpassd_gpu_clock_throttle_active", "tpassd_gpu_utilization_ratio",
            "tpassd_infiniband_rate_bytes_per_second"} <= names
    assert not names & set(OLD_NAMES)
    assert not any(n.endswith("_percent") or "gigabits" in n for n in names), sorted(names)
    assert not re.search(r'\bnode="', text.replace('tpassd_node_info{gpu_driver="fake-0.0",node="node1"}', ""))
    used = expr_names(dashboard_exprs())
    assert used and used <= names, sorted(used - names)
    rule_names = expr_names([RULES.read_text()])
    assert rule_names and rule_names <= names, sorted(rule_names - names)


@pytest.mark.parametrize("tpassd", [True], indirect=True)
def test_where_private_data_hides_jobs_job_id_is_left_out_and_jobs_are_summed(tpassd, munge):

    push_as_owner(tpassd, coordinator_report(42, time.monotonic()), munge)
    call(tpassd.ctl, "node1", "tpassd.job_metrics", coordinator_report(43, time.monotonic()), munge.socket)  # root
    text = scrape(tpassd)
    check_metrics(text)
    assert "job_id=" not in text
    assert "tpassd_jobs_reporting 2.0" in text
    assert 'tpassd_job_migrations_total{outcome="completed"} 2.0' in text
    assert "tpassd_job_ranks_registered 8.0" in text
    assert 'tpassd_job_pause_seconds_count{kind="migration"} 4.0' in text


@pytest.mark.parametrize("tpassd", [False], indirect=True)
def test_only_root_or_the_jobs_owner_may_report_and_a_bad_report_is_refused_whole(tpassd, munge):

    body = coordinator_report(42, time.monotonic())
    with pytest.raises(RemoteError) as ei:
        push_as_owner(tpassd, body, munge, uid=1002)
    assert ei.value.code == "forbidden"
    bad = {**body, "migrations": {"completed": 1, "exploded": 1}}
    with pytest.raises(RemoteError) as ei:
        push_as_owner(tpassd, bad, munge)
    assert ei.value.code == "bad_request" and "exploded" in ei.value.remote_message
    text = scrape(tpassd)
    assert "tpassd_jobs_reporting 0.0" in text and "tpassd_job_migrations_total" not in text
