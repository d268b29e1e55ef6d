"""The one send/recv pattern the pause does not cover, and that it does no harm.

Three gloo ranks train (gradients all-reduced by hand, the loss all-reduced after the step);
ranks 0 and 1 alone exchange a tensor by send/recv on the default group between the step's last
collective and its end (after the backward pass, before ``optimizer.step()``). Those two then
count step ends as in a pipeline over the default group (pg.py ``step_ended``) and rank 2 does
not, so their counts part: a pause at T stops ranks 0 and 1 at a point rank 2 never reaches
(docs/runtime.md, "What is covered", send/recv). Checked, against a mini coordinator speaking
the real protocol: the pause is armed by every rank but never quiesces (rank 2 stays below T,
waiting inside a collective for the stopped ranks); the coordinator's cancel (a resume with the
pause's generation, what the real one sends when ``pause_timeout_s`` runs out) lets every rank
go on (``cancelled``), and the training is the plain run's bit for bit, with no ``torchpass:``
line.
"""

from __future__ import annotations

import textwrap

import pytest

from torchpass.runtime.testing import MiniCoordinator, free_port, run_ranks

JOB = 4712
STEPS = 40
SCRIPT = textwrap.dedent(
    r"""
    import os, time, torch, torch.distributed as dist, torch.nn as nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(r)
    for s in range(int(os.environ["STEPS"])):
        loss = m(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad(); loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad); p.grad /= world
        t = torch.full((1,), float(r + s))
        if r == 0:  # ranks 0 and 1 alone, after the step's last collective, before its end
            dist.send(t, 1); dist.recv(t, 1)
        elif r == 1:
            got = torch.zeros(1); dist.recv(got, 0); dist.send(t, 0); t = got
        opt.step()
        l = loss.detach().clone(); dist.all_reduce(l)
        print(f"step={s} loss={l.item().hex()} peer={t.item()}", flush=True)
        time.sleep(0.05)
    dist.barrier()
    os._exit(0)  # plain torch 2.13 may abort at a normal exit (docs/runtime.md, "Unprotected jobs")
    """
)


def test_a_pause_that_cannot_complete_is_cancelled_and_training_goes_on_unchanged(tmp_path):
    env = {"STEPS": str(STEPS)}
    plain, _ = run_ranks(SCRIPT, 3, tmp_path, "plain", runtime=False, env=env)
    assert [len(o) for o in plain] == [STEPS] * 3
    seen: dict = {}
    with MiniCoordinator(3, JOB) as coord:
        def drive():
            coord.wait_registered()
            coord.wait_collectives(10)
            at, gen = coord.pause(margin=8)  # every rank accepts T
            with pytest.raises(TimeoutError, match="timed out waiting for quiesce"):
                coord.wait_quiesced(timeout=3)  # a pause that completes does so in < 1 s
            seen["at"], seen["counts"] = at, {r: v.collectives for r, v in coord.ranks.items()}
            coord.resume(gen, "127.0.0.1", free_port())  # the cancel: the pause's own generation
            seen["resumed"] = coord.wait_resumed(gen, timeout=30)

        out, errs = run_ranks(SCRIPT, 3, tmp_path, "rt", runtime=True, env=env, job_id=JOB,
                              coordinator=coord.endpoint, on_start=drive)
    # ranks 0 and 1 reached T; rank 2 did not (it waits inside a collective for them)
    assert seen["counts"][0] == seen["counts"][1] == seen["at"] > seen["counts"][2], seen
    assert all(v.get("cancelled") for v in seen["resumed"].values()), seen["resumed"]
    assert out == plain  # bit for bit, every step once
    assert not [ln for e in errs for ln in e.splitlines() if ln.startswith("torchpass:")], errs
