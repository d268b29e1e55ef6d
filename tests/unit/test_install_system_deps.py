"""scripts/install-system-deps.sh does not change a machine's release unannounced.

On Debian 12, Slurm 24.11 and CRIU 4.x come from trixie and bring trixie's libc6 and base along.
The script prints, in one line, what trixie would upgrade (from `apt-get -s`) and stops, unless
TORCHPASS_ALLOW_TRIXIE_BASE=1; only Slurm, CRIU, nftables and promtool get `-t trixie`. Run against a stand-in
`apt-get` (a script first on PATH that records its arguments) in a private mount namespace whose
/etc/debian_version says 12 and whose apt and sysusers directories are empty tmpfs: nothing is
installed and the host's /etc is untouched.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install-system-deps.sh"
# nftables too: trixie's criu brings trixie's libnftables1, which bookworm's nftables cannot use.
# promtool: bookworm has it only inside the prometheus server package.
TRIXIE_PACKAGES = {"slurmd", "slurmctld", "slurm-client", "libslurm-dev", "criu", "nftables", "promtool"}
OWN_SUITE_PACKAGES = {"munge", "iproute2", "gcc", "make", "util-linux", "procps"}

# What `apt-get -s install -t trixie ...` prints on a Debian 12 machine (abridged): upgrades of
# installed packages carry [OLD], new ones do not.
SIMULATION = """\
NOTE: This is only a simulation!
Inst base-files [12.4+deb12u9] (13.8+deb13u1 Debian:13.1/stable [amd64])
Inst libc6 [2.36-9+deb12u9] (2.41-12 Debian:13.1/stable [amd64])
Inst systemd [252.33-1~deb12u1] (257.8-1~deb13u2 Debian:13.1/stable [amd64])
Inst libslurm42t64 (24.11.5-2 Debian:13.1/stable [amd64])
Inst slurmd (24.11.5-2 Debian:13.1/stable [amd64])
Inst criu (4.1-1 Debian:13.1/stable [amd64])
Conf libc6 (2.41-12 Debian:13.1/stable [amd64])
"""

# apt-get: records its arguments; a simulation prints SIMULATION; installing criu "installs" a
# CRIU 4.1 (the stand-in criu below reports 3.17 until then, so the script has work to do).
STAND_IN_APT_GET = """#!/bin/bash
echo "$*" >> "$STANDIN_DIR/apt-get.log"
for a in "$@"; do
  [ "$a" = -s ] && { cat "$STANDIN_DIR/simulation.txt"; exit 0; }
done
for a in "$@"; do
  [ "$a" = criu ] && printf '#!/bin/sh\\necho "Version: 4.1"\\n' > "$STANDIN_DIR/bin/criu"
done
exit 0
"""


def run_script(tmp_path: Path, debian_version: str, *, allow: bool) -> tuple[subprocess.CompletedProcess, list]:
    standin = tmp_path / "standin"
    (standin / "bin").mkdir(parents=True)
    (standin / "simulation.txt").write_text(SIMULATION)
    (standin / "bin" / "apt-get").write_text(STAND_IN_APT_GET)
    (standin / "bin" / "criu").write_text('#!/bin/sh\necho "Version: 3.17"\n')
    for f in (standin / "bin").iterdir():
        f.chmod(0o755)
    version = tmp_path / "debian_version"
    version.write_text(debian_version + "\n")
    mounts = " && ".join([f"mount --bind {version} /etc/debian_version",
                          *(f"mount -t tmpfs tmpfs {d}" for d in
                            ("/etc/apt/sources.list.d", "/etc/apt/preferences.d", "/etc/sysusers.d"))])
    env = {**os.environ, "PATH": f"{standin / 'bin'}:{os.environ['PATH']}", "STANDIN_DIR": str(standin)}
    env.pop("TORCHPASS_ALLOW_TRIXIE_BASE", None)
    if allow:
        env["TORCHPASS_ALLOW_TRIXIE_BASE"] = "1"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                           f"{mounts} && exec bash {shlex.quote(str(SCRIPT))}"],
                          env=env, capture_output=True, text=True, timeout=120)
    log = standin / "apt-get.log"
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def installs(calls: list) -> list[tuple[bool, set]]:
    """Each real `apt-get install`: (with -t trixie?, the packages it names)."""
    out = []
    for argv in calls:
        if "install" in argv and "-s" not in argv:
            trixie = "-t" in argv and argv[argv.index("-t") + 1] == "trixie"
            names = {a for a in argv[argv.index("install") + 1:] if not a.startswith("-") and a != "trixie"}
            out.append((trixie, names))
    return out


@pytest.fixture(autouse=True)
def _root_only():
    assert os.geteuid() == 0, "runs the script in a private mount namespace (root)"


def test_debian_12_says_in_one_line_what_trixie_would_upgrade_and_stops(tmp_path):
    proc, calls = run_script(tmp_path, "12.8", allow=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("install-system-deps: on Debian 12, Slurm 24.11 and CRIU 4.x come from trixie")
    # libc6 first, then what follows it in apt's order; new packages are not upgrades
    assert ": libc6 2.36-9+deb12u9 -> 2.41-12, base-files 12.4+deb12u9 -> 13.8+deb13u1, " \
           "systemd 252.33-1~deb12u1 -> 257.8-1~deb13u2;" in line, line
    assert "libslurm42t64" not in line
    assert "TORCHPASS_ALLOW_TRIXIE_BASE=1" in line and "never a cluster node" in line
    assert installs(calls) == [], calls  # nothing installed
    assert any("-s" in argv for argv in calls)


def test_debian_12_with_the_base_allowed_takes_only_slurm_criu_nftables_and_promtool_from_trixie(tmp_path):
    proc, calls = run_script(tmp_path, "12.8", allow=True)
    assert proc.returncode == 0, proc.stderr
    assert "TORCHPASS_ALLOW_TRIXIE_BASE=1: trixie upgrades libc6 2.36-9+deb12u9 -> 2.41-12" in proc.stdout
    done = installs(calls)
    assert (True, TRIXIE_PACKAGES) in done, done
    trixie_named = set().union(*(names for trixie, names in done if trixie))
    assert trixie_named == TRIXIE_PACKAGES, done
    own_suite = set().union(*(names for trixie, names in done if not trixie))
    assert OWN_SUITE_PACKAGES <= own_suite and not own_suite & TRIXIE_PACKAGES, done


def test_debian_13_takes_everything_from_its_own_suite_without_asking(tmp_path):
    proc, calls = run_script(tmp_path, "13.8", allow=False)
    assert proc.returncode == 0, proc.stderr
    done = installs(calls)
    assert done and not any(trixie for trixie, _ in done), done
    assert TRIXIE_PACKAGES | OWN_SUITE_PACKAGES <= set().union(*(names for _, names in done))
    assert not any("-s" in argv for argv in calls)
