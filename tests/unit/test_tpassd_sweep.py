"""tpassd removes an ended job's migration images and hold files, and follows no link a user
planted (tpassd/sweep.py: migration images are removed when the job ends, whatever way it ends).
Slurm's job list comes from a fake client (the Tpassd/Sweeper seam for the Slurm client);
every path and process is real. Without tpassd/sweep.py nothing removes them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.fake_slurm import FakeSlurm
from torchpass import layout
from tpassd.main import sweep_job
from tpassd.sweep import Sweeper, dump_processes
from tpassd.testing import wait_for


@pytest.fixture(autouse=True)
def _own_state_dir_only(monkeypatch):
    """tpassd takes the jobs' state directory from $TORCHPASS_STATE_DIR when set (a shell with a
    devcluster's env): these tests must sweep their own tmp_path, never that one."""
    monkeypatch.delenv("TORCHPASS_STATE_DIR", raising=False)


def _slurm(states: dict[int, str] | None = None, fail: bool = False) -> FakeSlurm:
    """slurmctld running these jobs of user u (id -> state); ``fail``: squeue does not answer."""
    slurm = FakeSlurm()
    for job_id, state in (states or {}).items():
        slurm.run_job(job_id, state=state)
    if fail:
        slurm.refuse("jobs", "'squeue --json' did not finish in 15 s; is slurmctld up?")
    return slurm


def images(snap, job, rank, gen=1, size=1000):
    d = layout.images_dir(snap, job, rank, gen)
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"x" * size)
    return d


def hold(state, job, migration=1, rank=0):
    f = layout.hold_file(state, job, migration, rank)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("hold\n")
    return f


@pytest.fixture
def tree(tmp_path):
    snap, state, victim = tmp_path / "snap", tmp_path / "state", tmp_path / "victim"
    for d in (snap, state, victim):
        d.mkdir()
    (victim / "precious").write_text("keep me\n")
    (victim / "hold").mkdir()
    (victim / "hold" / "1.rank0").write_text("not the job's\n")
    return snap, state, victim


def unchanged(victim):
    assert (victim / "precious").read_text() == "keep me\n"
    assert (victim / "hold" / "1.rank0").read_text() == "not the job's\n"


def test_ended_jobs_files_go_running_jobs_stay(tree):
    snap, state, victim = tree
    ended, running, completing = images(snap, 5, 1), images(snap, 6, 0), images(snap, 9, 0)
    h5, h6 = hold(state, 5), hold(state, 6)
    (layout.job_dir(state, 5) / "events.json").write_text("[]")  # the event log outlives the job
    slurm = _slurm({6: "RUNNING", 9: "COMPLETING"})
    res = Sweeper(snap, state, lambda: slurm).sweep()
    assert not ended.exists() and not layout.snapshot_job_dir(snap, 5).exists()
    assert not h5.parent.exists() and layout.events_json(state, 5).exists()
    assert running.exists() and completing.exists() and h6.exists()
    assert sorted(res.removed) == sorted([str(layout.snapshot_job_dir(snap, 5)), str(h5.parent)])


def test_nothing_is_removed_when_slurm_cannot_say(tree):
    snap, state, _ = tree
    d, h = images(snap, 5, 1), hold(state, 5)
    res = Sweeper(snap, state, lambda: _slurm(fail=True)).sweep()
    assert d.exists() and h.exists() and "nothing removed" in res.skipped


def test_no_candidate_no_slurm_call(tree):
    snap, state, _ = tree
    slurm = _slurm()
    assert Sweeper(snap, state, lambda: slurm).sweep().removed == []
    assert slurm.count("jobs") == 0


def test_planted_symlinks_are_unlinked_never_followed(tree):
    """Links in the last component and in intermediate ones, in the user's hold directory and in
    the snapshot directory: each is removed or refused; every target is left unchanged."""
    snap, state, victim = tree
    images(snap, 5, 1)
    (layout.snapshot_job_dir(snap, 5) / "rank0.gen1").symlink_to(victim)  # a link as an image dir
    layout.snapshot_job_dir(snap, 7).symlink_to(victim)  # the job's whole snapshot dir a link
    h = hold(state, 5)
    (h.parent / "2.rank0").symlink_to(victim / "precious")  # a link as a hold file
    (h.parent / "sub").mkdir()
    (h.parent / "sub" / "deeper").symlink_to(victim)  # a link to a directory, one level down
    layout.job_dir(state, 7).mkdir(parents=True)
    (layout.job_dir(state, 7) / layout.HOLD).symlink_to(victim / "hold")  # the hold dir itself a link
    layout.job_dir(state, 8).symlink_to(victim)  # an intermediate directory a link (victim/hold exists)
    res = Sweeper(snap, state, lambda: _slurm({})).sweep()
    unchanged(victim)
    assert set(os.listdir(victim)) == {"precious", "hold"}
    assert not os.path.lexists(layout.snapshot_job_dir(snap, 5))
    assert not os.path.lexists(layout.snapshot_job_dir(snap, 7))  # the link itself unlinked
    assert not os.path.lexists(h.parent)
    assert not os.path.lexists(layout.job_dir(state, 7) / layout.HOLD)
    assert os.path.islink(layout.job_dir(state, 8))  # refused: not walked through, not removed
    assert str(layout.job_dir(state, 8) / layout.HOLD) not in res.removed


def test_a_dump_still_running_when_its_job_ended_is_aborted_then_removed(tree):
    snap, state, _ = tree
    d = images(snap, 5, 1)
    other = images(snap, 6, 1)
    # A stand-in for criu: a child of this process whose argv is a dump into the job's images.
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "dump", "-t", "1", "-D", str(d)])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "dump", "-D", str(other)])
    try:
        assert wait_for(lambda: [p.pid for p in dump_processes(snap, 5)] == [fake.pid])
        busy = lambda: {5} if fake.poll() is None else set()  # noqa: E731 - the op ends when its criu does
        res = Sweeper(snap, state, lambda: _slurm({6: "RUNNING"}), busy_jobs=busy).sweep()
        assert res.aborted == [fake.pid] and fake.wait(5) == -9
        assert not d.exists() and res.kept_busy == []
        assert bystander.poll() is None and other.exists()
    finally:
        for p in (fake, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_op_that_does_not_end_keeps_the_files(tree):
    snap, state, _ = tree
    d = images(snap, 5, 1)
    res = Sweeper(snap, state, lambda: _slurm({}), busy_jobs=lambda: {5}, busy_wait_s=0.1).sweep()
    assert res.kept_busy == [5] and d.exists()


def test_sweep_job_for_the_epilog(tree, capsys):
    from tpassd.testing import fake_node_config

    snap, state, _ = tree
    cfg = fake_node_config(snap.parent / "node", snapshot_dir=snap, state_dir=state)
    d, h = images(snap, 5, 1), hold(state, 5)
    assert sweep_job(cfg, 5, _slurm({5: "RUNNING"})) == 1
    assert "is RUNNING" in capsys.readouterr().err and d.exists() and h.exists()
    assert sweep_job(cfg, 5, _slurm({5: "COMPLETING"})) == 0
    assert not d.exists() and not h.exists()
    assert '"job_id": 5' in capsys.readouterr().out
    d = images(snap, 5, 2)
    assert sweep_job(cfg, 5, _slurm(fail=True)) == 0  # the Epilog's word is enough
    assert not d.exists()


def test_tpassd_sweeps_at_start(tmp_path, munge):
    from tpassd.daemon import Tpassd
    from tpassd.testing import fake_node_config

    cfg = fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15,
                           sweep_interval_s=300)
    d, h = images(cfg.snapshot_dir, 5, 1), hold(cfg.state_dir, 5)
    kept = images(cfg.snapshot_dir, 6, 1)
    node = Tpassd(cfg, slurm_client=_slurm({6: "RUNNING"})).start()
    try:
        assert wait_for(lambda: not d.exists() and not h.exists())
        assert kept.exists()
    finally:
        node.stop()


def test_sweep_interval_is_validated(tmp_path):
    from torchpass.errors import ConfigError
    from tpassd.config import load_config

    assert load_config(tmp_path / "none.toml", flags={"sweep_interval_s": 0}).sweep_interval_s == 0
    with pytest.raises(ConfigError, match="sweep_interval_s must be 0"):
        load_config(tmp_path / "none.toml", flags={"sweep_interval_s": 1})


def test_the_epilog_script_sweeps_the_job_and_always_exits_0(tree):
    from pathlib import Path

    snap, state, _ = tree
    script = Path(__file__).resolve().parents[2] / "contrib" / "epilog.d" / "torchpass-sweep"
    conf = snap.parent / "tpassd.toml"
    conf.write_text(f'snapshot_dir = "{snap}"\nstate_dir = "{state}"\nnvml_provider = "none"\n')
    d, h = images(snap, 5, 1), hold(state, 5)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "5", "TPASSD": str(Path(sys.executable).with_name("tpassd")),
           "TPASSD_CONFIG_FILE": str(conf), "SLURM_CONF": str(snap.parent / "no-slurm.conf")}
    assert subprocess.run([str(script)], env=env, timeout=60).returncode == 0
    assert not d.exists() and not h.exists()
    env["TPASSD_CONFIG_FILE"] = str(snap.parent / "missing.toml")  # tpassd fails: still 0
    assert subprocess.run([str(script)], env=env, timeout=60).returncode == 0


def _deep(top, depth: int, owner: int = 1001) -> None:
    """``depth`` nested directories below ``top`` (made with directory fds: the path is longer than
    PATH_MAX), as a user may make in their own hold directory."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            os.chown("d", owner, owner, dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("last", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("x")
    finally:
        os.close(fd)


def test_a_1500_deep_hold_directory_is_removed_and_other_jobs_are_still_swept(tmp_path):
    """A user's 1,500-deep hold tree made shutil.rmtree (recursive) raise RecursionError, which
    stopped the sweep of every job (and snapshot expiry after it) on every node."""
    snap, state = tmp_path / "snap", tmp_path / "state"
    snap.mkdir()
    h5, h7 = hold(state, 5), hold(state, 7)
    _deep(h5.parent, 1500)
    d7 = images(snap, 7, 0)
    try:
        res = Sweeper(snap, state, lambda: _slurm({})).sweep()
        assert res.failed == [] and not h5.parent.exists() and not h7.parent.exists() and not d7.exists()
        assert str(h5.parent) in res.removed
    finally:  # pytest's own clean-up of tmp_path recurses too: never leave the deep tree to it
        subprocess.run(["rm", "-rf", "--one-file-system", str(state)], timeout=60)


def test_one_jobs_failing_sweep_does_not_stop_the_others(tmp_path, monkeypatch):
    import tpassd.sweep as sweep_mod

    snap, state = tmp_path / "snap", tmp_path / "state"
    snap.mkdir()
    h5, h6 = hold(state, 5), hold(state, 6)
    real = sweep_mod.Sweeper.sweep_job

    def failing(self, job, res=None):
        if job == 5:
            raise RuntimeError("job 5's tree is broken")
        return real(self, job, res)

    monkeypatch.setattr(sweep_mod.Sweeper, "sweep_job", failing)
    res = Sweeper(snap, state, lambda: _slurm({})).sweep()
    assert res.failed == [5] and h5.exists() and not h6.exists()


def test_ended_jobs_state_directories_go_after_their_retention(tmp_path):
    snap, state = tmp_path / "snap", tmp_path / "state"
    snap.mkdir()
    now = 1_000_000.0
    dirs = {}
    for job in (5, 6, 7, 8):
        d = layout.job_dir(state, job)
        (d / "ranks").mkdir(parents=True)
        (d / "events.json").write_text("[]")
        dirs[job] = d
    layout.snapshot_manifests_dir(state, 8).mkdir()  # a snapshot to relaunch from: kept
    for job, age_h in ((5, 200), (6, 1), (7, 200), (8, 200)):
        os.utime(dirs[job], (now - age_h * 3600, now - age_h * 3600))
    res = Sweeper(snap, state, lambda: _slurm({7: "RUNNING"}), job_dir_retention_s=168 * 3600,
                  wall=lambda: now).sweep()
    assert not dirs[5].exists()  # ended a week+ ago
    assert dirs[6].exists() and dirs[7].exists() and dirs[8].exists()  # recent, running, has snapshots
    assert res.removed == [str(dirs[5])]
