"""The GPU check: `make gpu-check` on a machine with one NVIDIA GPU and no network.

Installs only from gpu-bundle/ (`make gpu-bundle`, carried with the working tree), then checks:
  nvml        tpassd's real NVML provider (``nvml_provider = "nvml"``) reads every GPU
  cuda-move   a CUDA training process paused, CUDA-checkpointed, CRIU-dumped, killed, restored,
              CUDA-restored and resumed: its next losses and parameters bit-identical to a run
              without the move
  nccl-move   the same with a one-rank NCCL group, destroyed before the checkpoint and rebuilt after
Each check's result is written to $OUT as soon as it ends (checks.jsonl, one line each), the whole
takes at most 5 minutes, a table is printed, and docs/hardware-validation.md's results block is
rewritten. Where there is no GPU it says so in one line and stops (exit 3); under gVisor, where
CRIU cannot work, it says so in one line and runs only the NVML check.

Not yet covered: the process is started and moved by this script with torchpass's CudaCheckpoint
and the criu binary, not under tpass-rankwrap and tpassd.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE = Path(os.environ.get("GPU_BUNDLE", REPO / "gpu-bundle"))
OUT = Path(os.environ.get("OUT") or REPO / "gpu-check-out")
DOC = REPO / "docs" / "hardware-validation.md"
BEGIN, END = "<!-- gpu-check results: begin -->", "<!-- gpu-check results: end -->"
DEADLINE = time.monotonic() + 300.0  # the whole check: 5 minutes
RESULTS: list[dict] = []


def say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


def record(name: str, status: str, detail: str, seconds: float, quiet: bool = False) -> None:
    """One check's result, on disk at once: a machine taken back mid-run still leaves it."""
    row = {"check": name, "status": status, "detail": " ".join(detail.split())[:500], "s": round(seconds, 2)}
    RESULTS.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "checks.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if not quiet:
        say(f"{name}: {status} ({row['s']} s) {row['detail']}")


def left(cap: float) -> float:
    return max(1.0, min(cap, DEADLINE - time.monotonic()))


def gvisor() -> str | None:
    """Why this kernel is gVisor's (its /proc/version and dmesg say so), or None."""
    try:
        version = Path("/proc/version").read_text()
    except OSError:
        version = ""
    try:
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        dmesg = ""
    if "gvisor" in dmesg.lower() or "gvisor" in version.lower():
        return "dmesg names gVisor"
    return None


def gpu_present() -> str | None:
    """The GPUs nvidia-smi lists (name, driver), or None when there are none."""
    if not any(p.name.startswith("nvidia") and p.name[6:].isdigit() for p in Path("/dev").iterdir()):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "a /dev/nvidia device (nvidia-smi not runnable)"
    return out.stdout.strip() or None


def install(py: str) -> str:
    """The check's Python: the image's (torch, nvidia-ml-py) in a venv with the bundle's wheels."""
    venv = Path(tempfile.gettempdir()) / "torchpass-gpu-check-venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([py, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=left(60))
    needed = ["pyzmq", "structlog", "blake3", "click", "psutil", "numpy", "nvidia-ml-py",
              "prometheus_client"]
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
                    str(BUNDLE / "wheels"), *needed], check=True, timeout=left(120))
    return str(venv / "bin" / "python")


def criu_env() -> tuple[str, dict]:
    """The bundle's criu binary, with its libraries."""
    root = BUNDLE / "criu" / "root"
    env = dict(os.environ, LD_LIBRARY_PATH=f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    return str(root / "bin" / "criu"), env


def check_nvml(py: str) -> None:
    t0 = time.monotonic()
    code = ("from tpassd.nvml_provider import select_provider\n"
            "from tpassd.collectors.nvml import NvmlCollector\n"
            "c = select_provider('nvml'); p = c.provider\n"
            "out = NvmlCollector(p, events=False).collect(0.0)\n"
            "bad = {g: {k: v for k, v in r.checks.items() if v} for g, r in out.items()}\n"
            "print(p.driver_version(), len(out), [r.metrics.get('uuid') for r in out.values()], bad)\n")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=left(60), cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    ok = r.returncode == 0
    record("nvml", "pass" if ok else "fail", (r.stdout if ok else r.stderr).strip()[-400:], time.monotonic() - t0)


def train(py: str, work: Path, name: str, extra: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([py, str(REPO / "scripts" / "gpu_check_train.py"), str(work / f"{name}.losses"), *extra],
                            cwd=work, stdin=subprocess.DEVNULL, stdout=open(work / f"{name}.out", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def check_move(py: str, name: str, nccl: bool) -> None:
    """Reference run, then the same run moved at step 20: losses and parameters compared bit for bit."""
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))
    env = dict(os.environ, PYTHONPATH=str(REPO), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    nccl_args = ["--nccl", str(work / "store")] if nccl else []
    try:
        ref = train(py, work, "ref", ["--nccl", str(work / "ref-store")] if nccl else [], env)
        if ref.wait(timeout=left(90)) != 0:
            raise RuntimeError(f"the reference run failed: {(work / 'ref.out').read_text()[-300:]}")
        ready, go = work / "ready", work / "go"
        p = train(py, work, "moved", [*nccl_args, "--pause-at", "19", "--ready", str(ready), "--go", str(go)], env)
        while not ready.exists():
            if p.poll() is not None or time.monotonic() > DEADLINE:
                raise RuntimeError(f"the run never paused: {(work / 'moved.out').read_text()[-300:]}")
            time.sleep(0.05)
        sys.path.insert(0, str(REPO))
        from torchpass.checkpoint.cuda import CudaCheckpoint

        cuda = CudaCheckpoint.load()
        times = {}
        t = time.monotonic()
        cuda.suspend(p.pid)
        times["cuda_checkpoint_s"] = time.monotonic() - t
        criu, cenv = criu_env()
        images = work / "images"
        images.mkdir()
        t = time.monotonic()
        subprocess.run([criu, "dump", "-t", str(p.pid), "-D", str(images), "-o", "dump.log", "--file-locks"],
                       check=True, timeout=left(90), env=cenv)
        times["criu_dump_s"] = time.monotonic() - t  # criu dump kills the tree when it is done
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)
        t = time.monotonic()
        subprocess.run([criu, "restore", "-D", str(images), "-o", "restore.log", "-d", "--file-locks"],
                       check=True, timeout=left(90), env=cenv)
        times["criu_restore_s"] = time.monotonic() - t
        t = time.monotonic()
        cuda.resume(p.pid)
        times["cuda_restore_s"] = time.monotonic() - t
        size_mb = sum(f.stat().st_size for f in images.iterdir()) / 1e6
        go.touch()
        deadline = time.monotonic() + left(90)
        while "params" not in (work / "moved.losses").read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("the restored run did not finish")
            time.sleep(0.1)
        ref_lines = (work / "ref.losses").read_text().splitlines()
        moved_lines = (work / "moved.losses").read_text().splitlines()
        same = ref_lines == moved_lines
        detail = (f"{'bit-identical' if same else 'DIFFERENT'} losses and params over {len(ref_lines) - 1} steps; "
                  f"image {size_mb:.0f} MB; " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
        record(name, "pass" if same else "fail", detail, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - every check reports, whatever broke
        logs = " ".join(Path(f).read_text()[-200:] for f in (work / "images" / "dump.log",
                                                            work / "images" / "restore.log") if Path(f).exists())
        record(name, "fail", f"{type(exc).__name__}: {exc} {logs}", time.monotonic() - t0)


def write_doc(card: str) -> None:
    rows = ["| check | result | seconds | detail |", "|---|---|---|---|"]
    rows += [f"| {r['check']} | {r['status']} | {r['s']} | {r['detail'].replace('|', '/')} |" for r in RESULTS]
    block = f"{BEGIN}\nRun {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on: {card}\n\n" + "\n".join(rows) \
        + f"\n{END}"
    text = DOC.read_text()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
        DOC.write_text(text)
        shutil.copy(DOC, OUT / "hardware-validation.md")
    print("\n".join(rows))


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "checks.jsonl").unlink(missing_ok=True)
    card = gpu_present()
    if card is None:
        say("no GPU on this machine (no /dev/nvidia<N>): nothing to check")
        record("gpu", "absent", "no /dev/nvidia<N>", 0.0, quiet=True)
        return 3
    under_gvisor = gvisor()
    if under_gvisor:
        say(f"the kernel is gVisor ({under_gvisor}): CRIU cannot work here; ask for the nvidia-h100-x1 kind")
    py = install(os.environ.get("GPU_CHECK_PYTHON", sys.executable))
    check_nvml(py)
    if under_gvisor:
        for name in ("cuda-move", "nccl-move"):
            record(name, "skipped", "gVisor: no CRIU", 0.0)
    else:
        check_move(py, "cuda-move", nccl=False)
        check_move(py, "nccl-move", nccl=True)
    write_doc(card)
    return 0 if all(r["status"] == "pass" for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
