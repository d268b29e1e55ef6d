"""The common ways of starting a job, with and without the runtime.

Each form runs as 2 real gloo ranks on 127.0.0.1, once with the runtime
loaded through boot/sitecustomize.py and once with it switched off
(TORCHPASS_RUNTIME=0): the same losses bit for bit (float.hex) and the same
exit code. Protected forms make the default group a ``ReconfigurablePG`` and
print no ``torchpass:`` line; do-no-harm forms keep torch's own group and say
why in one line.

* ``init_process_group()`` with no arguments (env://: RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT): protected.
* ``init_method="tcp://host:port"`` with ``rank=``/``world_size=``, and with
  them in the URL's query: protected.
* a store passed by the script: do no harm (unprotected, one line).
* under srun without RANK/WORLD_SIZE (only SLURM_PROCID/SLURM_NTASKS): torch
  fails (its env:// rendezvous reads no SLURM_* variable); with the runtime it
  fails the same way, with the same exit code (a runtime that read
  SLURM_PROCID would run the job where it fails without torchpass).
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from torchpass.runtime.testing import launch_ranks, run_ranks

SCRIPT = textwrap.dedent(
    r"""
    import os, time, torch, torch.distributed as dist, torch.nn as nn
    torch.set_num_threads(1)
    form, rank, world = os.environ["FORM"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if form == "noargs":
        dist.init_process_group()
    elif form == "tcp":
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    elif form == "tcp_query":
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}?rank={rank}&world_size={world}")
    elif form == "store":
        store = dist.TCPStore(addr, port, world, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    elif form == "slurm":  # what srun exports, without the script's own RANK/WORLD_SIZE
        os.environ["SLURM_PROCID"], os.environ["SLURM_NTASKS"] = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
        dist.init_process_group("gloo")
    print("group", type(dist.distributed_c10d._get_default_group()).__name__, dist.get_backend(), flush=True)
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for s in range(int(os.environ.get("STEPS", "4"))):
        loss = m(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad(); loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad); p.grad /= world
        opt.step()
        l = loss.detach().clone(); dist.all_reduce(l)
        print(f"step={s} loss={l.item().hex()}", flush=True)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    dist.barrier()
    # no teardown: plain torch with tcp:// sometimes aborts at exit ("terminate called without
    # an active exception") once the store's server rank has gone; this test is about training
    os._exit(0)
    """
)


def _run(tmp_path, form: str, runtime: bool):
    tag = f"{form}.{'rt' if runtime else 'plain'}"
    return run_ranks(SCRIPT, 2, tmp_path, tag, runtime=runtime, env={"FORM": form}, timeout=120)


@pytest.mark.parametrize("form", ["noargs", "tcp", "tcp_query"])
def test_a_covered_form_is_protected_and_trains_as_without_the_runtime(tmp_path, form):
    plain, _ = _run(tmp_path, form, runtime=False)
    wrapped, errs = _run(tmp_path, form, runtime=True)
    backend = "undefined" if form == "noargs" else "gloo"  # torch's no-argument init binds backends lazily
    assert all(out[0] == f"group ProcessGroup {backend}" for out in plain), plain
    assert all(out[0] == f"group ReconfigurablePG {backend}" for out in wrapped), (wrapped, errs)
    assert all("torchpass:" not in e for e in errs), errs
    assert [o[1:] for o in wrapped] == [o[1:] for o in plain] and len(plain[0]) == 5


def test_a_store_passed_by_the_script_runs_unprotected_and_unchanged(tmp_path):
    plain, _ = _run(tmp_path, "store", runtime=False)
    wrapped, errs = _run(tmp_path, "store", runtime=True)
    assert wrapped == plain and plain[0][0] == "group ProcessGroup gloo", (wrapped, plain)
    for e in errs:
        lines = [ln for ln in e.splitlines() if ln.startswith("torchpass:")]
        assert lines == ["torchpass: init_process_group was given its own store; training runs unprotected"], e


def test_srun_without_rank_fails_as_torch_fails(tmp_path):
    """torch's env:// rendezvous needs RANK; the runtime must not start a job torch refuses."""
    def run(runtime: bool):
        tag = f"slurm.{'rt' if runtime else 'plain'}"
        procs = launch_ranks([sys.executable, "-c", SCRIPT], 2, tmp_path, tag, runtime=runtime,
                             env={"FORM": "slurm"})
        codes = [p.wait(120) for p in procs]
        errs = [(tmp_path / f"{tag}.{r}.err").read_text() for r in range(2)]
        outs = [(tmp_path / f"{tag}.{r}.out").read_text() for r in range(2)]
        return codes, errs, outs

    codes, errs, outs = run(False)
    assert codes == [1, 1] and all("environment variable RANK expected" in e for e in errs), errs
    w_codes, w_errs, w_outs = run(True)
    assert w_codes == codes and w_outs == outs == ["", ""], (w_codes, w_errs)
    for e in w_errs:
        assert "environment variable RANK expected" in e, e
        assert [ln for ln in e.splitlines() if ln.startswith("torchpass:")] == [
            "torchpass: rank, world size or the rendezvous address unknown (as torch would need them); "
            "training runs unprotected"], e
