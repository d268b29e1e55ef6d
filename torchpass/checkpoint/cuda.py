"""CUDA checkpoint of a process through the driver API (driver >= 570).

``cuCheckpointProcessLock / Checkpoint / Restore / Unlock / GetState`` move a
process's GPU state into host memory (so CRIU can dump it) and back. Order on
the source: the rank's runtime has destroyed its NCCL communicators (the
pause), then ``lock`` -> ``checkpoint`` -> CRIU dump. On the target: CRIU
restore (the process stays frozen in the "checkpointed" state) ->
``restore`` -> ``unlock`` -> the runtime rebuilds NCCL.

Loaded lazily through ctypes from tpassd (root); nothing here needs torch.
Without libcuda or without these symbols, DependencyError says which.
Not validated on hardware in this repository's CI (no GPU): the tests give
tpassd's dump a stand-in for this class (``cuda_loader``), so a real driver's
suspend and resume of a CUDA context is checked only on a GPU node.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
from collections.abc import Callable

from torchpass.errors import CheckpointError, DependencyError

SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)
LIB_NAMES = ("libcuda.so.1", "libcuda.so")


class ProcessState(enum.IntEnum):
    # CUprocessState (cuda.h, driver API 12.8+)
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):
    # CUcheckpointGpuPair (cuda.h): two CUuuid, 16 bytes each.
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    # CUcheckpointRestoreArgs (cuda.h, driver 570+): 64 bytes, the rest reserved and zeroed.
    # Later drivers put customStorageInfo_out in what is reserved here; zero means "not used".
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - 8)), ("reserved1", ctypes.c_uint64)]


RESTORE_ARGS_SIZE = 64


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU UUID as NVML and nvidia-smi print it ("GPU-" and 32 hex digits).

    MIG devices ("MIG-...") are refused: the CUDA checkpoint remaps whole GPUs."""
    text = uuid.strip()
    if text.startswith("MIG-"):
        raise CheckpointError(f"{text} is a MIG device: a rank on MIG devices cannot be moved "
                              "(the CUDA checkpoint remaps whole GPUs)")
    hexpart = text.removeprefix("GPU-").replace("-", "")
    try:
        raw = bytes.fromhex(hexpart)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise CheckpointError(f"{uuid!r} is not a GPU UUID (GPU- and 32 hex digits)")
    return raw


def gpu_pair_table(source: list[str] | tuple[str, ...], target: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """Source GPU -> target GPU in local order: the rank's n-th GPU on the source becomes the
    n-th GPU allocated to its restore step. The restored process keeps its source
    environment (CUDA_VISIBLE_DEVICES too), and CUDA's device n stays device n: only the
    UUID behind it changes, so the table must cover every GPU the rank used."""
    if len(target) < len(source):
        raise CheckpointError(f"the rank used {len(source)} GPU(s) but its restore step has {len(target)}: "
                              "it is not started without its GPUs")
    for u in (*source, *target[:len(source)]):
        uuid_bytes(u)
    return list(zip(source, target[:len(source)], strict=True))


def restore_args(pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> tuple[_RestoreArgs, object]:
    """CUcheckpointRestoreArgs for ``pairs``; the second value owns the pair array (keep it alive
    until the call returns)."""
    args = _RestoreArgs()
    if not pairs:
        return args, None
    array = (_GpuPair * len(pairs))()
    for slot, (old, new) in zip(array, pairs, strict=True):
        slot.oldUuid[:] = uuid_bytes(old)
        slot.newUuid[:] = uuid_bytes(new)
    args.gpuPairs = ctypes.cast(array, ctypes.POINTER(_GpuPair))
    args.gpuPairsCount = len(pairs)
    return args, array


class _UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


def _load_default() -> ctypes.CDLL:
    errors = []
    for name in LIB_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise DependencyError(
        "libcuda not found (" + "; ".join(errors)[:200] + "): GPU ranks cannot be checkpointed on this node; "
        "install the NVIDIA driver >= 570"
    )


class CudaCheckpoint:
    """The five driver entry points; build with ``CudaCheckpoint.load()``."""

    def __init__(self, lib):
        missing = [s for s in SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise DependencyError(
                f"the NVIDIA driver's libcuda lacks {', '.join(missing)}: CUDA checkpoint needs driver >= 570; "
                "upgrade the driver"
            )
        self._lib = lib
        self._init = getattr(lib, "cuInit", None)
        self._err_str = getattr(lib, "cuGetErrorString", None)
        for s in SYMBOLS:
            getattr(lib, s).restype = ctypes.c_int
        self._initialised = False

    @classmethod
    def load(cls, loader: Callable[[], object] = _load_default) -> "CudaCheckpoint":
        return cls(loader())

    def _error(self, rc: int) -> str:
        if self._err_str is not None:
            msg = ctypes.c_char_p()
            try:
                if self._err_str(ctypes.c_int(rc), ctypes.byref(msg)) == 0 and msg.value:
                    return msg.value.decode(errors="replace")
            except Exception:  # noqa: BLE001
                pass
        return f"CUresult {rc}"

    def _call(self, name: str, pid: int, *args) -> None:
        if not self._initialised and self._init is not None:
            rc = self._init(ctypes.c_uint(0))
            if rc != 0:
                raise CheckpointError(f"cuInit failed ({self._error(rc)}): no usable GPU driver on this node")
            self._initialised = True
        rc = getattr(self._lib, name)(ctypes.c_int(pid), *args)
        if rc != 0:
            raise CheckpointError(f"{name}(pid {pid}) failed: {self._error(rc)}")

    def state(self, pid: int) -> ProcessState:
        out = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(out))
        try:
            return ProcessState(out.value)
        except ValueError:
            raise CheckpointError(
                f"cuCheckpointProcessGetState(pid {pid}) returned unknown state {out.value}"
            ) from None

    def lock(self, pid: int, timeout_ms: int = 10_000) -> None:
        args = _LockArgs(timeoutMs=timeout_ms)
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.byref(_CheckpointArgs()))

    def restore(self, pid: int, pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...] = ()) -> None:
        """``pairs``: (source UUID, target UUID) for every GPU the process used, or none to restore
        onto the same GPUs (an abort on the source)."""
        args, keep = restore_args(pairs)
        self._call("cuCheckpointProcessRestore", pid, ctypes.byref(args))
        del keep

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, ctypes.byref(_UnlockArgs()))

    # -- the two sequences tpassd runs ------------------------------------------
    def suspend(self, pid: int, timeout_ms: int = 10_000) -> None:
        """Source side, before the CRIU dump: lock, then move GPU state to host memory."""
        if self.state(pid) == ProcessState.CHECKPOINTED:
            return
        self.lock(pid, timeout_ms)
        try:
            self.checkpoint(pid)
        except CheckpointError:
            try:
                self.unlock(pid)
            finally:
                raise
        if (st := self.state(pid)) != ProcessState.CHECKPOINTED:
            raise CheckpointError(f"pid {pid} is {st.name} after cuCheckpointProcessCheckpoint, not CHECKPOINTED")

    def resume(self, pid: int, pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...] = ()) -> None:
        """Target side after the CRIU restore (or source side on abort): restore, then unlock.
        ``pairs`` remaps the source's GPUs onto the target's (``gpu_pair_table``)."""
        st = self.state(pid)
        if st == ProcessState.CHECKPOINTED:
            self.restore(pid, pairs)
            st = self.state(pid)
        if st == ProcessState.LOCKED:
            self.unlock(pid)
        elif st != ProcessState.RUNNING:
            raise CheckpointError(f"pid {pid} is {st.name} after cuCheckpointProcessRestore")
