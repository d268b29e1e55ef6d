#!/usr/bin/env bash
# Install the system packages torchpass needs on a Debian 12 or 13 host:
# munge, Slurm 24.11 (slurmd, slurmctld, client, headers), CRIU >= 4.0,
# iproute2, gcc, make, systemd-analyze and python3-venv (the job Python, see
# torchpass/devcluster/jobpython.py, is a venv made from /usr/bin/python3). Idempotent: does nothing when all are present.
#
# Debian 12 (bookworm) ships CRIU 3.17, which fails on current kernels, and
# Slurm 22.05; both come from the Debian 13 (trixie) suite through an APT pin
# of priority 100, so nothing else on the machine is upgraded by default.
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

packages=(munge slurmd slurmctld slurm-client libslurm-dev criu iproute2 gcc make util-linux procps)
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
    && command -v systemd-analyze >/dev/null 2>&1 && venv_ok
}
venv_ok() { /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1; }

if all_ok; then
  echo "install-system-deps: all present (slurm $(slurmd -V | awk '{print $2}'), criu $(criu --version | sed -n 's/^Version: *//p'))"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive

if [ "$debian_major" = 12 ]; then
  # The trixie suite, pinned low: only what we ask for with -t trixie comes from it.
  if ! grep -rqs "trixie" /etc/apt/sources.list /etc/apt/sources.list.d/; then
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
if ! apt-get install -y -qq --no-install-recommends "${suite_flag[@]}" "${packages[@]}" >/tmp/torchpass-apt.log 2>&1; then
  # A half-configured install (e.g. the sysusers problem above) can be finished.
  dpkg --configure -a >>/tmp/torchpass-apt.log 2>&1 || true
  apt-get install -y -qq --no-install-recommends "${suite_flag[@]}" "${packages[@]}" >>/tmp/torchpass-apt.log 2>&1 \
    || die "apt-get install of ${packages[*]} failed; see /tmp/torchpass-apt.log"
fi

# systemd-analyze checks the tpassd unit (tests/unit/test_systemd_unit.py); from the
# machine's own suite, never the pinned one.
command -v systemd-analyze >/dev/null 2>&1 || apt-get install -y -qq --no-install-recommends systemd \
  >>/tmp/torchpass-apt.log 2>&1 || die "apt-get install systemd failed; see /tmp/torchpass-apt.log"

venv_ok || apt-get install -y -qq --no-install-recommends "${py_packages[@]}" \
  >>/tmp/torchpass-apt.log 2>&1 || die "apt-get install ${py_packages[*]} failed; see /tmp/torchpass-apt.log"

criu_ok || die "criu >= 4.0 is required, found '$(criu --version 2>/dev/null | head -1)'; on Debian 12 it comes from trixie"
slurm_ok || die "Slurm >= 24 with headers (libslurm-dev) is required, found '$(slurmd -V 2>/dev/null)'"
all_ok || die "a required tool is still missing after install (munged, ip, nsenter, gcc, make, systemd-analyze, python3 -m venv)"
echo "install-system-deps: installed (slurm $(slurmd -V | awk '{print $2}'), criu $(criu --version | sed -n 's/^Version: *//p'))"
