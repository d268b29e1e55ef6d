"""The CUDA restore remaps the source's GPUs onto the restore step's: the bytes libcuda receives.

The stand-in libcuda's entry points are C function pointers (ctypes callbacks), so
cuCheckpointProcessRestore receives a raw CUcheckpointRestoreArgs* exactly as the driver
would, and the test reads the 64 bytes and the pair array behind it from memory. The layout
is NVIDIA's (cuda.h, CUDA driver API "CUcheckpointRestoreArgs"): gpuPairs pointer at 0,
gpuPairsCount (unsigned int) at 8, reserved bytes zeroed, 64 bytes in all; each
CUcheckpointGpuPair is oldUuid then newUuid, 16 bytes each.
"""

from __future__ import annotations

import ctypes
import struct

import pytest

from torchpass.checkpoint import cuda
from torchpass.errors import CheckpointError

SOURCE = ["GPU-1f0e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "GPU-00112233-4455-6677-8899-aabbccddeeff"]
TARGET = ["GPU-ffeeddcc-bbaa-9988-7766-554433221100", "GPU-0a0b0c0d-0e0f-1011-1213-141516171819",
          "GPU-99999999-9999-9999-9999-999999999999"]


class CLibcuda:
    """libcuda's five checkpoint entry points as C callbacks, with the driver's state machine."""

    def __init__(self):
        self.state = cuda.ProcessState.CHECKPOINTED
        self.restore_args: list[bytes] = []
        self.restore_pairs: list[bytes] = []
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p)

        def get_state(pid, out):
            ctypes.c_int.from_address(out).value = int(self.state)
            return 0

        def restore(pid, args):
            raw = ctypes.string_at(args, cuda.RESTORE_ARGS_SIZE)
            self.restore_args.append(raw)
            pointer, count = struct.unpack_from("=QI", raw, 0)
            self.restore_pairs.append(ctypes.string_at(pointer, 32 * count) if count else b"")
            if self.state != cuda.ProcessState.CHECKPOINTED:
                return 401
            self.state = cuda.ProcessState.LOCKED
            return 0

        def unlock(pid, args):
            self.state = cuda.ProcessState.RUNNING
            return 0

        def unused(pid, args):
            return 999

        self._keep = [proto(f) for f in (get_state, restore, unlock, unused)]
        self.cuCheckpointProcessGetState, self.cuCheckpointProcessRestore, self.cuCheckpointProcessUnlock, \
            stub = self._keep
        self.cuCheckpointProcessLock = self.cuCheckpointProcessCheckpoint = stub


def test_restore_args_carry_every_pair_in_local_order():
    lib = CLibcuda()
    pairs = cuda.gpu_pair_table(SOURCE, TARGET)
    assert pairs == [(SOURCE[0], TARGET[0]), (SOURCE[1], TARGET[1])]
    cuda.CudaCheckpoint(lib).resume(4242, pairs)
    assert lib.state == cuda.ProcessState.RUNNING
    (raw,), (pair_bytes,) = lib.restore_args, lib.restore_pairs
    assert len(raw) == 64 and ctypes.sizeof(cuda._RestoreArgs) == 64
    pointer, count = struct.unpack_from("=QI", raw, 0)
    assert pointer != 0 and count == 2
    assert raw[12:] == bytes(52)  # reserved: zeroed
    assert pair_bytes == b"".join(bytes.fromhex(u[4:].replace("-", "")) for u in
                                  (SOURCE[0], TARGET[0], SOURCE[1], TARGET[1]))


def test_no_pairs_is_all_zero_and_restores_onto_the_same_gpus():
    lib = CLibcuda()
    cuda.CudaCheckpoint(lib).resume(4242)
    assert lib.restore_args == [bytes(64)] and lib.restore_pairs == [b""]


def test_too_few_gpus_mig_and_garbage_are_one_line_refusals():
    with pytest.raises(CheckpointError, match=r"used 2 GPU\(s\) but its restore step has 1") as exc:
        cuda.gpu_pair_table(SOURCE, TARGET[:1])
    assert "\n" not in str(exc.value)
    with pytest.raises(CheckpointError, match="MIG device"):
        cuda.gpu_pair_table(["MIG-4b5a6978-8796-a5b4-c3d2-e1f000000000"], TARGET[:1])
    with pytest.raises(CheckpointError, match="not a GPU UUID"):
        cuda.gpu_pair_table(["GPU-12"], TARGET[:1])
