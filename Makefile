# torchpass developer entry points. Both `make demo` and `make test` install
# what is missing (apt packages, the virtualenv, the SPANK plugin) and are
# idempotent; run them as root on Debian 12 or 13.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
WHEELS := $(wildcard /opt/wheels)
PIP_FIND_LINKS_FLAG := $(if $(WHEELS),--find-links $(WHEELS),)
PYTEST_ARGS ?=
# pytest-xdist processes for the pure tier, and devclusters side by side for the cluster tier
# (the integration tests mostly wait on jobs: two clusters share 2 cores well).
PYTEST_WORKERS ?= 2
CLUSTER_WORKERS ?= 2
# The job Python: a venv from the system Python that every job user can read
# (root's Python and this checkout may not be). A second checkout on the same
# machine can keep its own: make test JOB_VENV=/opt/torchpass-dev/jobvenv-2.
JOB_VENV ?= /opt/torchpass-dev/jobvenv
export TORCHPASS_JOB_VENV := $(JOB_VENV)

.PHONY: gpu-bundle gpu-check
.PHONY: all deps venv jobvenv spank dist dist-offline release-check lint lint-imports test test-fast unit integration demo bench clean

all: venv spank

# scripts/install-system-deps.sh is for a devcluster or CI machine, never a cluster node. On
# Debian 12 it stops before trixie's Slurm and CRIU upgrade the machine's libc6 and base, unless
# TORCHPASS_ALLOW_TRIXIE_BASE=1, which `make demo` and `make test` (and so CI) set, and say so.
demo test: export TORCHPASS_ALLOW_TRIXIE_BASE := 1
deps: .deps.stamp
.deps.stamp: scripts/install-system-deps.sh
	@[ "$$TORCHPASS_ALLOW_TRIXIE_BASE" != 1 ] || echo "make: TORCHPASS_ALLOW_TRIXIE_BASE=1:" \
		"on Debian 12 this machine takes trixie's libc6 and base with its Slurm and CRIU"
	bash scripts/install-system-deps.sh
	@touch $@

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FIND_LINKS_FLAG) -e '.[runtime,dev,plot]'
	@touch $@

# Always run: it copies only the sources that changed (about 0.1 s when
# nothing did), pip runs only for a new venv or a changed pyproject.toml.
jobvenv: deps venv
	$(PY) -m torchpass.devcluster.jobpython --venv $(JOB_VENV) $(PIP_FIND_LINKS_FLAG)

spank: deps
	$(MAKE) -C slurm_spank

# The release: dist/torchpass-VERSION.tar.gz (the sdist: the packages, slurm_spank/, contrib/,
# docs/, tests/, LICENSE) and dist/torchpass-VERSION-py3-none-any.whl, built from that sdist, so
# a file the sdist lacks fails the wheel's build. docs/admin.md installs from the wheel file.
DIST_DIR ?= dist
dist: venv
	rm -rf $(DIST_DIR)
	$(PY) -m build --no-isolation --outdir $(DIST_DIR) .

# For a site with no package index: the wheel and every wheel its base install needs, in
# DIST_DIR/offline (`pip install --no-index --find-links DIST_DIR/offline torchpass`). It asks this
# machine's package index for the dependencies, so it is not part of `make test`.
dist-offline: dist
	$(PY) -m pip wheel -q --wheel-dir $(DIST_DIR)/offline $(DIST_DIR)/torchpass-*.whl

# The release as an admin installs it (docs/admin.md, sections 1 and 2), from `make dist`: the wheel
# in a fresh venv that every job user can run (torch from the same wheels as the job Python), the
# plugin and tpass-init from `make -C slurm_spank install` into RELEASE_ROOT. From that venv:
# tests/release (the sdist's and wheel's contents; every program's --help and --version; one
# devcluster job, moved by `tpassctl migrate`, on the installed plugin and programs), then the
# unit tests of tpassctl's commands (the files that import tpassctl, but the devcluster's).
# On tmpfs: the venv is 1 GB of torch, which a loaded machine's disk took 59 s to remove and about
# as long again to write (tmpfs: 0.4 s to remove); it is removed when the check passes.
RELEASE_VENV ?= /dev/shm/torchpass-$(notdir $(JOB_VENV))-wheel
RELEASE_ROOT ?= /dev/shm/torchpass-$(notdir $(JOB_VENV))-wheel-root
release-check: deps venv jobvenv spank dist
	rm -rf $(RELEASE_VENV) $(RELEASE_ROOT)
	install -d -m 0755 $(RELEASE_VENV) $(RELEASE_ROOT)
	$(MAKE) -C slurm_spank install PREFIX=/usr DESTDIR=$(RELEASE_ROOT)
	/usr/bin/python3 -m venv $(RELEASE_VENV)
	$(RELEASE_VENV)/bin/python -m pip install -q --disable-pip-version-check $(PIP_FIND_LINKS_FLAG) \
		torch==2.13.0 pytest pytest-timeout hypothesis "$$(ls $(DIST_DIR)/torchpass-*.whl)[plot]"
	TORCHPASS_TEST_DIST_DIR=$(abspath $(DIST_DIR)) TORCHPASS_TEST_INSTALL_ROOT=$(RELEASE_ROOT) \
		$(RELEASE_VENV)/bin/python -I -m pytest tests/release -q -p no:cacheprovider $(PYTEST_ARGS)
	$(RELEASE_VENV)/bin/python -I -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) $(CLI_UNIT_TESTS)
	rm -rf $(RELEASE_VENV) $(RELEASE_ROOT)

# The unit files of tpassctl's commands (those that import tpassctl, but the devcluster's): the
# release check runs them, pure and host tests alike, from the installed wheel, so `make test`
# leaves them out of its pure and host tiers (193 tests, 26 s from the wheel; running them twice
# cost CI about 40 s more).
CLI_UNIT_TESTS = $(shell grep -lE '^(from|import) tpassctl' tests/unit/test_*.py | grep -v devcluster)

# The test tiers (tests/support/tiers.py): pure (this process only), host (root, CRIU, munged,
# rank processes) and cluster (a devcluster per pytest-xdist worker).
# The pure tier, on PYTEST_WORKERS processes: under a minute.
test-fast: venv
	$(PY) -m pytest tests/unit -m pure -n $(PYTEST_WORKERS) -q -p no:cacheprovider $(PYTEST_ARGS)

unit: venv
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

# One devcluster per worker; a module's tests stay on one worker (its module-scoped jobs and
# reference runs share that worker's cluster).
integration: deps venv jobvenv spank
	$(PY) -m pytest tests/integration -m cluster -n $(CLUSTER_WORKERS) --dist loadfile -q $(PYTEST_ARGS)

# pyflakes, pycodestyle, import order and the `noqa`s' rules: pyproject.toml [tool.ruff].
lint: venv
	$(VENV)/bin/ruff check .

# Which package may import which: the contracts in pyproject.toml [tool.importlinter].
lint-imports: venv
	$(VENV)/bin/lint-imports --no-cache

test: deps venv jobvenv spank lint lint-imports release-check
	$(PY) -m pytest tests/unit -m pure -n $(PYTEST_WORKERS) -q -p no:cacheprovider $(PYTEST_ARGS) \
		$(addprefix --ignore=,$(CLI_UNIT_TESTS))
	$(PY) -m pytest tests/unit tests/integration -m host -q -p no:cacheprovider $(PYTEST_ARGS) \
		$(addprefix --ignore=,$(CLI_UNIT_TESTS))
	$(PY) -m pytest tests/integration -m cluster -n $(CLUSTER_WORKERS) --dist loadfile -q -p no:cacheprovider $(PYTEST_ARGS)

demo: deps venv jobvenv spank
	$(PY) examples/demo.py

bench: deps venv jobvenv spank
	$(PY) bench/run_all.py

clean:
	$(MAKE) -C slurm_spank clean
	rm -rf $(VENV) .deps.stamp $(DIST_DIR)

# The GPU check's offline bundle (gpu-bundle/, <= 64 MiB: cp312 wheels and criu), built here with
# network; and the check itself, run on a one-GPU machine from that bundle only (scripts/gpu_check.py).
gpu-bundle: venv
	bash scripts/gpu-bundle.sh

gpu-check:
	$(or $(GPU_CHECK_PYTHON),python3) scripts/gpu_check.py
