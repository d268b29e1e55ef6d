"""Never left paused (docs/coordinator.md, "Never left paused"): what a quiesced rank does on its
own when no resume comes by its pause's deadline. A held copy first claims the rank
(``claim``: exactly one copy goes on); the source copy that goes on calls the hand-off off
(``call_off_handoff``); the ranks of the fallback's resume must then all join within join_s
(``watch_join``), else each says who is missing and exits 1, so that Slurm ends the job at once
instead of at its time limit."""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
from collections.abc import Callable

from torchpass import layout
from torchpass.runtime.pg import Rendezvous
from torchpass.runtime.say import say

# A restored copy claims its rank this much later than the source copy would: the source wins
# whenever it is alive.
RESTORED_CLAIM_DELAY_S = 60.0
# How long the ranks of a resume in place without the coordinator wait for each other (the pause
# command's join_s, the policy's rebuild_timeout_s, when it has one).
FALLBACK_JOIN_S = 120.0
# The fallback rendezvous' own keys on rank 0's store (beside the generations' gen<g>/ keys).
FALLBACK_KEY = "torchpass-fallback/gen{gen}"


def pause_terms(cmd: dict) -> dict | None:
    """A pause command's deadline_s, fallback and join_s (None: an older coordinator sent none)."""
    fb = cmd.get("fallback")
    if (not isinstance(fb, dict) or cmd.get("deadline_s") is None
            or any(k not in fb for k in ("generation", "master_addr", "master_port"))):
        return None
    return {"deadline_s": float(cmd["deadline_s"]), "fallback": fb,
            "join_s": float(cmd.get("join_s") or FALLBACK_JOIN_S)}


def claim(hold: str, rank: int) -> bool | None:
    """``hold_file.claim``, O_CREAT|O_EXCL on the shared state directory: exactly one copy gets it
    (True); another copy has it (False); it cannot be made (None, said)."""
    try:
        fd = os.open(hold + ".claim", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        say(f"rank {rank}: cannot claim the rank ({hold}.claim: {exc}); not resuming, so that no two "
            "copies of it go on")
        return None
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def call_off_handoff(rank_dir: str | None, job_id: int, rank: int) -> None:
    """The source copy goes on where it is: call the hand-off off as a rollback's tpassd does
    (``op=abort``: marker "abort"; the rank record back to this copy if a restored copy had
    taken it), so that this copy's task wrapper reports its exit code instead of waiting for
    a moved rank's, and the restored copy's wrapper writes none (torchpass.checkpoint.rankwrap)."""
    if not rank_dir:
        return
    from torchpass.checkpoint import safeio

    record = layout.rank_record(rank_dir, job_id, rank)
    try:
        dfd = os.open(record.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        say(f"rank {rank}: cannot call the move off in {record.parent} ({exc}); its task may wait "
            "for a moved copy")
        return
    try:
        try:
            rec = json.loads(safeio.read_regular(record.name, safeio.MAX_RECORD_BYTES, dir_fd=dfd))
        except (OSError, ValueError):
            rec = {}
        prev = rec.get("previous") if isinstance(rec, dict) else None
        if rec.get("restored_from") and isinstance(prev, dict) and prev.get("wrapper_pid"):
            safeio.write_at(dfd, record.name, json.dumps(prev).encode())
        safeio.write_at(dfd, layout.handoff(rank_dir, job_id, rank).name, b"abort\n")
    except OSError as exc:
        say(f"rank {rank}: cannot call the move off in {record.parent} ({exc}); its task may wait "
            "for a moved copy")
    finally:
        os.close(dfd)


def watch_join(pg, rank: int, node: str, gen: int, rv: Rendezvous, join_s: float, rebuilt: threading.Event,
               clock: Callable[[], float], exit: Callable[[int], None]) -> None:
    """Every rank of the fallback must join within join_s; else one line and exit 1.

    Each rank sets its own key on rank 0's store (its own client, beside the
    rebuild's), so the line names who is missing: rank 0 itself when its
    store never answers.
    """
    import torch.distributed as dist

    end = clock() + join_s
    prefix = FALLBACK_KEY.format(gen=gen)
    store = None
    while not rebuilt.wait(0.2):
        left = end - clock()
        if left <= 0:
            break
        if store is None:
            try:
                store = dist.TCPStore(rv.master_addr, rv.master_port, pg.size(), False,
                                      datetime.timedelta(seconds=max(0.5, min(2.0, left))),
                                      wait_for_workers=False)
                store.set(f"{prefix}/rank{rank}", node)
            except Exception:  # noqa: BLE001 - rank 0's store is not up (yet)
                store = None
    if rebuilt.is_set():
        return
    try:
        missing = ([r for r in range(pg.size()) if not store.check([f"{prefix}/rank{r}"])]
                   if store is not None else [0])
    except Exception:  # noqa: BLE001 - rank 0 went away meanwhile
        missing = [0]
    who = (f"rank(s) {', '.join(map(str, missing))} did not join within {join_s:g} s "
           "(the moved rank has no live copy)" if missing else f"the group did not rebuild within {join_s:g} s")
    say(f"rank {rank}: resume in place without the coordinator failed: {who}; the job cannot go on")
    exit(1)
