"""boot/sitecustomize.py: a no-op without a torchpass job, chains to the
sitecustomize it shadows, and never breaks the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchpass.runtime import boot_dir

PROBE = (
    "import sys; hooked = any(type(f).__name__ == '_Finder' for f in sys.meta_path); "
    "print('hooked' if hooked else 'plain'); "
    "print('torch' if 'torch' in sys.modules else 'no-torch')"
)


def py(code: str, env_extra: dict, pythonpath: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "PYTHON"))}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_no_job_id_means_nothing_happens():
    r = py(PROBE, {}, [boot_dir()])
    assert r.returncode == 0 and r.stdout.split() == ["plain", "no-torch"] and r.stderr == ""


def test_runtime_0_means_nothing_happens():
    r = py(PROBE, {"TORCHPASS_JOB_ID": "12", "TORCHPASS_RUNTIME": "0"}, [boot_dir()])
    assert r.stdout.split() == ["plain", "no-torch"] and r.stderr == ""


def test_job_id_installs_the_hook_without_importing_torch():
    r = py(PROBE, {"TORCHPASS_JOB_ID": "12"}, [boot_dir()])
    assert r.returncode == 0 and r.stdout.split() == ["hooked", "no-torch"], r.stderr


def test_patch_happens_when_torch_distributed_loads():
    code = "import torch.distributed as d; print(hasattr(d.init_process_group, '__torchpass_orig__'))"
    assert py(code, {"TORCHPASS_JOB_ID": "12"}, [boot_dir()]).stdout.strip() == "True"
    assert py(code, {}, [boot_dir()]).stdout.strip() == "False"


def test_chains_to_the_shadowed_sitecustomize(tmp_path: Path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.CHAINED = 'yes'\n")
    code = "import builtins; print(getattr(builtins, 'CHAINED', 'no'))"
    for env in ({}, {"TORCHPASS_JOB_ID": "12"}):
        r = py(code, env, [boot_dir(), str(other)])
        assert r.stdout.strip() == "yes", r.stderr


def test_a_broken_runtime_prints_one_line_and_python_runs(tmp_path: Path):
    # a 'torchpass' package without the runtime shadows the real one
    fake = tmp_path / "fake" / "torchpass"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError(\"broken install\")\n")
    r = py("print('training ran')", {"TORCHPASS_JOB_ID": "12"}, [boot_dir(), str(fake.parent)])
    assert r.returncode == 0 and r.stdout.strip() == "training ran"
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchpass: runtime not loaded"), r.stderr


def test_uncovered_init_falls_back_with_one_line(tmp_path: Path):
    code = (
        "import torch.distributed as d; "
        f"d.init_process_group('gloo', init_method='file://{tmp_path}/rdv', rank=0, world_size=1); "
        "print(type(d.distributed_c10d._get_default_group()).__name__); d.destroy_process_group()"
    )
    r = py(code, {"TORCHPASS_JOB_ID": "12"}, [boot_dir()])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ProcessGroup"
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("torchpass:")] == [
        f"torchpass: init_method 'file://{tmp_path}/rdv' is not covered (env:// and tcp:// are);"
        " training runs unprotected"
    ]


def test_a_torch_outside_the_tested_range_is_not_patched_and_says_so_once(tmp_path: Path):
    """torch 2.11 (stood in for by TORCHPASS_TEST_TORCH_VERSION: one torch is installed here):
    the runtime patches nothing, one line says why, and training runs on torch's own group."""
    code = (
        "import torch, torch.distributed as d; from torch.distributed import distributed_c10d as c; "
        "print(hasattr(d.init_process_group, '__torchpass_orig__'), 'TORCHPASS' in d.Backend._plugins); "
        f"d.init_process_group('gloo', init_method='file://{tmp_path}/rdv', rank=0, world_size=1); "
        "t = torch.ones(2); d.all_reduce(t); print(type(c._get_default_group()).__name__, t.tolist()); "
        "d.destroy_process_group()"
    )
    r = py(code, {"TORCHPASS_JOB_ID": "12", "TORCHPASS_TEST_TORCH_VERSION": "2.11.0"}, [boot_dir()])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["False False", "ProcessGroup [1.0, 1.0]"]
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("torchpass:")] == [
        "torchpass: torch 2.11.0 is outside the tested range (2.13); the runtime patches nothing;"
        " training runs unprotected"], r.stderr


def test_a_site_allowed_torch_is_patched_and_says_so(tmp_path: Path):
    code = "import torch.distributed as d; print(hasattr(d.init_process_group, '__torchpass_orig__'))"
    r = py(code, {"TORCHPASS_JOB_ID": "12", "TORCHPASS_TEST_TORCH_VERSION": "2.11.0",
                  "TORCHPASS_ALLOW_TORCH": "2.11"}, [boot_dir()])
    assert r.stdout.strip() == "True", r.stderr
    assert r.stderr.splitlines() == ["torchpass: torch 2.11.0 is outside the tested range (2.13); patched because "
                                     "TORCHPASS_ALLOW_TORCH=2.11"]
