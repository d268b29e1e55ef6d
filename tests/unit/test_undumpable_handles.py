"""A rank holding handles CRIU cannot dump (NCCL's verbs devices) is found from /proc before the dump."""

from __future__ import annotations

import os
from pathlib import Path

from torchpass.checkpoint.criu import undumpable_handles


def fake_proc(root: Path, tree: dict[int, list[int]], fds: dict[int, dict[int, str]],
              maps: dict[int, list[str]]) -> str:
    """A /proc with the files undumpable_handles reads: task/T/children, fd/N links, maps."""
    for pid, children in tree.items():
        task = root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, children)))
        (root / str(pid) / "fd").mkdir()
        for fd, target in fds.get(pid, {}).items():
            os.symlink(target, root / str(pid) / "fd" / str(fd))
        (root / str(pid) / "maps").write_text("".join(line + "\n" for line in maps.get(pid, [])))
    return str(root)


def test_verbs_devices_and_io_uring_anywhere_in_the_tree_are_found(tmp_path):
    proc = fake_proc(
        tmp_path, {10: [11], 11: [12], 12: []},
        fds={10: {0: "/dev/null", 1: "pipe:[123]"},
             11: {3: "/dev/nvidia0", 4: "socket:[9]"},
             12: {7: "/dev/infiniband/uverbs0", 8: "/dev/infiniband/rdma_cm", 9: "anon_inode:[io_uring]"}},
        maps={11: ["7f00-7f10 rw-s 00000000 00:05 12 /dev/nvidiactl"],
              12: ["7f20-7f30 rw-s 00000000 00:05 99 /dev/infiniband/uverbs0",
                   "7f40-7f50 r-xp 00000000 08:01 5 /usr/lib/libibverbs.so.1"]})
    assert undumpable_handles(10, proc) == [
        "12: /dev/infiniband/rdma_cm", "12: /dev/infiniband/uverbs0", "12: anon_inode:[io_uring]"]


def test_a_gpu_rank_without_verbs_devices_is_dumpable(tmp_path):
    proc = fake_proc(tmp_path, {10: []}, fds={10: {3: "/dev/nvidia0", 4: "/dev/nvidia-uvm"}},
                     maps={10: ["7f00-7f10 rw-s 00000000 00:05 12 /dev/nvidia0", "7f20-7f30 rw-p 00000000 00:00 0"]})
    assert undumpable_handles(10, proc) == []


def test_a_mapping_left_after_its_fd_was_closed_is_found(tmp_path):
    # The verbs library mmaps the device's doorbell pages; closing the fd keeps the mapping.
    proc = fake_proc(tmp_path, {10: []}, fds={},
                     maps={10: ["7f20-7f30 rw-s 00000000 00:05 99 /dev/infiniband/uverbs1"]})
    assert undumpable_handles(10, proc) == ["10: /dev/infiniband/uverbs1"]
