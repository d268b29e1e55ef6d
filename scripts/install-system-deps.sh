#!/usr/bin/env bash
# Install the system packages torchpass's devcluster and CI need on a Debian 12 or 13 host:
# munge, Slurm 24.11 (slurmd, slurmctld, client, headers), CRIU >= 4.0,
# iproute2, gcc, make, systemd-analyze, promtool (the tests check tpassd's /metrics and the alert
# rules with it) and python3-venv (the job Python, see
# torchpass/devcluster/jobpython.py, is a venv made from /usr/bin/python3). Idempotent: does nothing when all are present.
#
# It is for a development or CI machine that runs the devcluster, never a cluster node: a
# cluster's nodes keep the Slurm and CRIU their admins chose (docs/admin.md).
#
# Debian 12 (bookworm) ships CRIU 3.17, which fails on current kernels, and Slurm 22.05.
# Trixie's Slurm 24.11 and CRIU 4.1 need libc6 >= 2.38, so on Debian 12 they cannot come
# without trixie's base: libc6 and what follows it (base-files, systemd, gcc, ...), which moves
# the machine to Debian 13 in effect. So on Debian 12 the script first prints, in one line, what
# trixie would upgrade (read from `apt-get -s`), and goes on only with
# TORCHPASS_ALLOW_TRIXIE_BASE=1 (`make demo`, `make test` and CI set it). Only Slurm, CRIU,
# nftables (trixie's CRIU brings trixie's libnftables1) and promtool (bookworm has it only inside
# the prometheus server package) are installed with `-t trixie`; the other packages come from the machine's own suite, and the
# trixie suite stays pinned at priority 100, so a later `apt-get upgrade` takes nothing from it.
set -euo pipefail

die() { echo "install-system-deps: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (apt-get install); rerun with sudo"
[ -r /etc/debian_version ] || die "only Debian 12 or 13 is supported (no /etc/debian_version)"

debian_major=$(cut -d. -f1 </etc/debian_version)
case "$debian_major" in
  12) suite_flag=(-t trixie) ;;
  13|trixie*|forky*|sid*) suite_flag=() ;;
  *) die "Debian $(cat /etc/debian_version) is not supported; use Debian 12 or 13" ;;
esac

# From the machine's own suite.
packages=(munge iproute2 gcc make util-linux procps)
# From trixie on Debian 12 (-t trixie), from the machine's own suite on 13.
# nftables: the devcluster's loss= link drill; from trixie, as criu brings trixie's libnftables1.
# promtool: tests/unit/test_prometheus*.py; trixie's is its own package (bookworm ships it only
# inside the prometheus server package).
trixie_packages=(slurmd slurmctld slurm-client libslurm-dev criu nftables promtool)
# The system Python's venv module (with ensurepip), from the machine's own suite.
py_packages=(python3 python3-venv)

criu_ok() {
  command -v criu >/dev/null 2>&1 || return 1
  local v; v=$(criu --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\).*/\1/p')
  [ -n "$v" ] && [ "$v" -ge 4 ]
}
slurm_ok() {
  command -v slurmd >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 \
    && command -v sbatch >/dev/null 2>&1 && [ -f /usr/include/slurm/spank.h ] \
    && [ "$(slurmd -V 2>/dev/null | awk '{print $2}' | cut -d. -f1)" -ge 24 ]
}
all_ok() {
  criu_ok && slurm_ok && command -v munged >/dev/null 2>&1 \
    && command -v ip >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1 \
    && command -v gcc >/dev/null 2>&1 && command -v make >/dev/null 2>&1 \
    && command -v systemd-analyze >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && venv_ok
}
venv_ok() { /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1; }

if all_ok; then
  echo "install-system-deps: all present (slurm $(slurmd -V | awk '{print $2}'), criu $(criu --version | sed -n 's/^Version: *//p'))"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
added_source=0

if [ "$debian_major" = 12 ]; then
  # The trixie suite, pinned low: only what we ask for with -t trixie comes from it.
  if ! grep -rqs "trixie" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    added_source=1
    cat >/etc/apt/sources.list.d/torchpass-trixie.sources <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  fi
  cat >/etc/apt/preferences.d/torchpass-trixie <<'EOF'
Package: *
Pin: release n=trixie
Pin-Priority: 100
EOF
  # trixie's slurm postinst runs bookworm's systemd-sysusers, which rejects the
  # packaged "u! slurm" line; this override (same uid) is accepted by both.
  mkdir -p /etc/sysusers.d
  [ -f /etc/sysusers.d/slurm-wlm-basic-plugins.conf ] || \
    echo 'u slurm 64030 - /nonexistent' >/etc/sysusers.d/slurm-wlm-basic-plugins.conf
fi

apt-get update -qq >/dev/null || die "apt-get update failed; check the machine's package sources"

# What -t trixie would upgrade of what is installed ("Inst PKG [OLD] (NEW ...)" lines of the
# simulation), libc6 first: the packages that change the machine's release.
trixie_upgrades() {
  apt-get -s install --no-install-recommends -t trixie "${trixie_packages[@]}" 2>/dev/null \
    | awk '$1 == "Inst" && $3 ~ /^\[/ { old = substr($3, 2, length($3) - 2); new = substr($4, 2);
             line = $2 " " old " -> " new; if ($2 == "libc6") first = line; else rest = rest ", " line }
           END { out = first rest; sub(/^, /, "", out); print out }'
}

if [ "$debian_major" = 12 ]; then
  upgrades=$(trixie_upgrades)
  if [ -n "$upgrades" ] && [ "${TORCHPASS_ALLOW_TRIXIE_BASE:-}" != 1 ]; then
    # The suite and pin stay only where they were already: a refused run leaves apt as it found it.
    [ "$added_source" = 1 ] && rm -f /etc/apt/sources.list.d/torchpass-trixie.sources \
      /etc/apt/preferences.d/torchpass-trixie
    die "on Debian 12, Slurm 24.11 and CRIU 4.x come from trixie and would upgrade this machine's base: $upgrades; this script is for a devcluster or CI machine, never a cluster node: rerun with TORCHPASS_ALLOW_TRIXIE_BASE=1 to go on"
  fi
  [ -z "$upgrades" ] || echo "install-system-deps: TORCHPASS_ALLOW_TRIXIE_BASE=1: trixie upgrades $upgrades"
fi

apt_install() {  # apt_install [-t SUITE] PACKAGE...
  if ! apt-get install -y -qq --no-install-recommends "$@" >>/tmp/torchpass-apt.log 2>&1; then
    # A half-configured install (e.g. the sysusers problem above) can be finished.
    dpkg --configure -a >>/tmp/torchpass-apt.log 2>&1 || true
    apt-get install -y -qq --no-install-recommends "$@" >>/tmp/torchpass-apt.log 2>&1 \
      || die "apt-get install $* failed; see /tmp/torchpass-apt.log"
  fi
}
: >/tmp/torchpass-apt.log
apt_install "${packages[@]}"
apt_install "${suite_flag[@]}" "${trixie_packages[@]}"

# systemd-analyze checks the tpassd unit (tests/unit/test_systemd_unit.py); from the
# machine's own suite, never the pinned one.
command -v systemd-analyze >/dev/null 2>&1 || apt-get install -y -qq --no-install-recommends systemd \
  >>/tmp/torchpass-apt.log 2>&1 || die "apt-get install systemd failed; see /tmp/torchpass-apt.log"

venv_ok || apt-get install -y -qq --no-install-recommends "${py_packages[@]}" \
  >>/tmp/torchpass-apt.log 2>&1 || die "apt-get install ${py_packages[*]} failed; see /tmp/torchpass-apt.log"

criu_ok || die "criu >= 4.0 is required, found '$(criu --version 2>/dev/null | head -1)'; on Debian 12 it comes from trixie"
slurm_ok || die "Slurm >= 24 with headers (libslurm-dev) is required, found '$(slurmd -V 2>/dev/null)'"
all_ok || die "a required tool is still missing after install (munged, ip, nsenter, gcc, make, systemd-analyze, promtool, python3 -m venv)"
echo "install-system-deps: installed (slurm $(slurmd -V | awk '{print $2}'), criu $(criu --version | sed -n 's/^Version: *//p'))"
