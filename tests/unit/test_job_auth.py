"""Who may talk to a job's coordinator: rank.* signed with the job secret, job.status/events per
Slurm's PrivateData (munge from a private munged; another uid's credential via setpriv)."""

import os
import threading

import pytest

from torchpass import auth, jobauth, wire, zmqio
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.server import CoordinatorServer
from torchpass.errors import ConfigError, RemoteError
from torchpass.slurm.conf import job_privacy
from tpassd.testing import credential_as

SECRET_A = jobauth.parse_secret("0123456789abcdef" * 4)
SECRET_B = jobauth.parse_secret("fedcba9876543210" * 4)
BODY = {"job_id": 42, "rank": 0, "world_size": 2, "node": "n1", "pid": 10}


class Wall:
    def __init__(self, t=1.8e9):
        self.t = t

    def __call__(self):
        return self.t


def signed(signer, type_="rank.register", body=BODY, id_="i-1") -> wire.Message:
    return wire.decode(wire.encode(type_, body, id=id_, **signer.envelope(type_, id_, body)))


def refused(verifier, msg, match):
    with pytest.raises(auth.AuthFailure, match=match) as ei:
        verifier.verify(msg)
    assert ei.value.code == "unauthenticated"


# --- torchpass.jobauth -------------------------------------------------------------------------
def test_signed_request_is_accepted_once_and_anything_else_refused():
    wall = Wall()
    signer, verifier = jobauth.JobSigner(SECRET_A, wall=wall), jobauth.JobVerifier(SECRET_A, wall=wall)
    first = signed(signer)
    verifier.verify(first)
    refused(verifier, first, "replayed")
    verifier.verify(signed(signer, id_="i-2"))
    # the same user's other job: its own secret
    refused(verifier, signed(jobauth.JobSigner(SECRET_B, wall=wall)), "not signed with this job's secret")
    # unsigned, or a signature moved onto another body / type / id
    refused(verifier, wire.decode(wire.encode("rank.register", BODY)), "not signed with the job secret")
    env = signer.envelope("rank.register", "i-3", BODY)
    for type_, body, id_ in (("rank.register", {**BODY, "rank": 1}, "i-3"), ("rank.register", BODY, "i-4"),
                             ("rank.progress", {"job_id": 42, "rank": 0, "step": 1, "collectives": 1}, "i-3")):
        refused(verifier, wire.decode(wire.encode(type_, body, id=id_, **env)), "not signed with this job's secret")
    refused(verifier, wire.decode(wire.encode("rank.register", BODY, id="i-3", **{**env, "sender": "0" * 16})),
            "not signed with this job's secret")
    refused(verifier, wire.decode(wire.encode("rank.register", BODY, id="i-3", auth=env["auth"])),
            "lacks a valid sender")


def test_a_copy_restored_from_a_snapshot_signs_anew_where_its_images_counter_is_refused():
    """The snapshot's image holds the signer at sequence 1; its source went on to 3 before it was
    lost. The restored copy's next request (sequence 2) is a replay to the coordinator; renewed,
    it is a new sender and accepted."""
    wall = Wall()
    signer, verifier = jobauth.JobSigner(SECRET_A, wall=wall), jobauth.JobVerifier(SECRET_A, wall=wall)
    verifier.verify(signed(signer, id_="i-1"))
    image = jobauth.JobSigner(SECRET_A, wall=wall, sender=signer.sender)  # as CRIU restores it
    image._seq = signer._seq
    verifier.verify(signed(signer, id_="i-2"))
    verifier.verify(signed(signer, id_="i-3"))
    refused(verifier, signed(image, id_="i-4"), r"replayed \(sequence 2, last 3\)")
    old = image.sender
    image.renew()
    assert image.sender != old
    verifier.verify(signed(image, id_="i-5"))


def test_old_or_far_future_signatures_are_refused_and_old_senders_forgotten():
    wall = Wall()
    verifier = jobauth.JobVerifier(SECRET_A, wall=wall, window_s=300, max_senders=2)
    early = jobauth.JobSigner(SECRET_A, wall=Wall(wall.t - 301))
    refused(verifier, signed(early), "signed 301 s away")
    late = jobauth.JobSigner(SECRET_A, wall=Wall(wall.t + 400))
    refused(verifier, signed(late), "signed 400 s away")
    old = signed(jobauth.JobSigner(SECRET_A, wall=wall))
    verifier.verify(old)
    wall.t += 400
    for _ in range(3):  # more senders than max_senders: the one not heard of for a window goes
        verifier.verify(signed(jobauth.JobSigner(SECRET_A, wall=wall)))
    assert old.sender not in verifier._last
    refused(verifier, old, "away from this clock")  # forgotten, and still refused


def test_rank_without_a_secret_signs_nothing_and_a_bad_secret_is_one_line(tmp_path):
    assert jobauth.signer_from_env({}) is None
    with pytest.raises(ConfigError, match="TORCHPASS_JOB_SECRET is not a torchpass job secret"):
        jobauth.signer_from_env({"TORCHPASS_JOB_SECRET": "xyz"})
    assert jobauth.signer_from_env({"TORCHPASS_JOB_SECRET": SECRET_A.decode()}) is not None
    r, w = os.pipe()
    os.write(w, SECRET_A + b"\n")
    os.close(w)
    assert jobauth.read_secret_fd(r) == SECRET_A
    with pytest.raises(OSError):
        os.fstat(r)  # closed after reading


# --- the coordinator --------------------------------------------------------------------------
def serve(server):
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    return t


@pytest.fixture
def two_jobs():
    """One user's two jobs, each with its coordinator and its own secret."""
    servers = {42: CoordinatorServer(JobState(job_id=42), bind_address="127.0.0.1", job_secret=SECRET_A),
               43: CoordinatorServer(JobState(job_id=43), bind_address="127.0.0.1", job_secret=SECRET_B)}
    threads = [serve(s) for s in servers.values()]
    yield {j: f"tcp://127.0.0.1:{s.port}" for j, s in servers.items()}, servers
    for s in servers.values():
        s.stop()
    for t in threads:
        t.join(5)


def test_a_rank_of_the_users_other_job_is_refused(two_jobs):
    eps, servers = two_jobs
    # A rank of job 43 (secret B) speaks to job 42's coordinator, naming job 42.
    with pytest.raises(RemoteError, match="not signed with this job's secret") as ei:
        zmqio.request(eps[42], "rank.register", BODY, timeout_s=2, retries=0, auth=jobauth.JobSigner(SECRET_B))
    assert ei.value.code == "unauthenticated" and servers[42].state.ranks == {}
    zmqio.request(eps[42], "rank.register", BODY, timeout_s=2, retries=0, auth=jobauth.JobSigner(SECRET_A))
    assert list(servers[42].state.ranks) == [0]
    assert servers[42].counters["auth_failed"] == 1
    st = zmqio.request(eps[42], "job.status", {}, timeout_s=2, retries=0)  # PrivateData off: anyone
    assert st["coordinator"]["rank_auth"] == "job-secret"


@pytest.fixture
def private_job(munge):
    server = CoordinatorServer(JobState(job_id=42), bind_address="127.0.0.1", owner_uid=os.getuid(),
                               munge_socket=munge.socket, private_jobs=True, admin_uids=frozenset({0, 64030}))
    t = serve(server)
    yield f"tcp://127.0.0.1:{server.port}", munge.socket
    server.stop()
    t.join(5)


@pytest.mark.parametrize("type_,body", [("job.status", {}), ("job.events", {"since_seq": 0})])
def test_private_job_is_shown_to_its_owner_and_admins_only(private_job, type_, body):
    ep, sock = private_job
    digest = auth.request_digest(type_, body, auth.job_target(42))

    def ask(cred):
        return zmqio.request(ep, type_, body, timeout_s=5, retries=0, auth=cred)

    assert ask(auth.make_credential(digest, sock)) is not None  # the owner
    assert ask(credential_as(64030, 64030, digest, sock)) is not None  # SlurmUser
    with pytest.raises(RemoteError,
                       match=r"uid 65534 does not own job 42 \(only its owner or an admin may see it\)") as ei:
        ask(credential_as(65534, 65534, digest, sock))
    assert ei.value.code == "forbidden"
    with pytest.raises(RemoteError, match="no munge credential") as ei:
        ask(None)
    assert ei.value.code == "unauthenticated"
    other = auth.request_digest(type_, body, auth.job_target(43))  # a credential for another job
    with pytest.raises(RemoteError, match="different request"):
        ask(auth.make_credential(other, sock))


def test_private_data_and_admins_come_from_slurm_conf(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmUser=nobody\nPrivateData=accounts,Jobs\n")
    assert job_privacy(str(conf)) == (True, frozenset({0, 65534}))
    conf.write_text("SlurmUser=root\nPrivateData=usage\n")
    assert job_privacy(str(conf)) == (False, frozenset({0}))
    conf.write_text("PrivateData=all\n")
    assert job_privacy(str(conf))[0] is True
    assert job_privacy(str(tmp_path / "missing.conf")) == (True, frozenset({0}))  # unknown: private
