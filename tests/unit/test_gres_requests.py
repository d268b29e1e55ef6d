"""A GPU job's restore steps and spares ask Slurm for what the replaced task had; a CPU job's as before."""

from __future__ import annotations

from types import SimpleNamespace

from test_slurm_gres import JOB_D, STEP_D
from tests.support.fake_slurm import FakeSlurm
from torchpass.coordinator import contract as ct
from torchpass.coordinator.model import CoordState, SpareHow
from torchpass.coordinator.restore_steps import RestoreSteps
from torchpass.coordinator.spare_actions import SpareActions
from torchpass.slurm.base import StepInfo


class RecordingSlurm(FakeSlurm):
    """Slurm's -d records of a GPU job (or, with ``gpus=False``, of a CPU one)."""

    def __init__(self, gpus: bool):
        super().__init__(steps={4711: [StepInfo("4711.batch", "batch", ("gpu1",), "RUNNING"),
                                       StepInfo("4711.0", "python", ("gpu1", "gpu2", "gpu4"), "RUNNING")]})
        self.run_job(4711, nodes=("gpu1", "gpu2", "gpu4"), partition="gpu")
        self.gpus = gpus

    def job_detail(self, job_id):
        text = JOB_D if self.gpus else JOB_D.replace(" GRES=gpu:h100:2(IDX:0-1)", " GRES=").replace(
            " GRES=gpu:h100:2(IDX:2,3)", " GRES=")
        self.calls.append(("job_detail", job_id))
        return text

    def step_detail(self, step_id):
        self.calls.append(("step_detail", step_id))
        return STEP_D if self.gpus else STEP_D.replace(",gres/gpu=6,gres/gpu:h100=6", "")


def ports(slurm, tmp_path):
    policy = SimpleNamespace(spare_timeout_s=30.0)
    return SimpleNamespace(slurm=slurm, job_id=4711, srun="srun", python="python", rank_dir=tmp_path,
                           state_dir=tmp_path, policy=policy, wall=lambda: 0.0)


def test_a_gpu_jobs_restore_step_and_spare_ask_for_the_tasks_gpus_cpus_and_memory(tmp_path):
    slurm = RecordingSlurm(gpus=True)
    argv = RestoreSteps(ports(slurm, tmp_path), output="out").restore_argv(ct.Restore("m1", 1, "spare1", "img", "c"))
    assert argv[argv.index("-n1") + 1:argv.index("--torchpass=off")] == [
        "--cpus-per-task=4", "--mem=8192M", "--gres=gpu:1"]
    assert "--overlap" not in argv and "--exact" in argv
    assert ("step_detail", "4711.0") in slurm.calls
    req = SpareActions(ports(slurm, tmp_path)).spare_request(ct.RequestSpare("m1", SpareHow.COMPANION, "gpu4"),
                                                             CoordState(job_id=4711))
    assert req.resources == ("--cpus-per-task=8", "--mem=16384M", "--gres=gpu:h100:2")


def test_a_cpu_jobs_restore_step_and_spare_are_asked_for_as_before(tmp_path):
    slurm = RecordingSlurm(gpus=False)
    argv = RestoreSteps(ports(slurm, tmp_path), output="out").restore_argv(ct.Restore("m1", 1, "spare1", "img", "c"))
    assert argv[2:8] == ["--overlap", "-w", "spare1", "-N1", "-n1", "--torchpass=off"]
    req = SpareActions(ports(slurm, tmp_path)).spare_request(ct.RequestSpare("m1", SpareHow.COMPANION, "gpu4"),
                                                             CoordState(job_id=4711))
    assert req.resources == ()
