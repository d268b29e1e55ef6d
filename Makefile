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

.PHONY: all deps venv jobvenv spank lint lint-imports test test-fast unit integration demo bench clean

all: venv spank

deps: .deps.stamp
.deps.stamp: scripts/install-system-deps.sh
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

test: deps venv jobvenv spank lint lint-imports
	$(PY) -m pytest tests/unit -m pure -n $(PYTEST_WORKERS) -q -p no:cacheprovider $(PYTEST_ARGS)
	$(PY) -m pytest tests/unit tests/integration -m host -q -p no:cacheprovider $(PYTEST_ARGS)
	$(PY) -m pytest tests/integration -m cluster -n $(CLUSTER_WORKERS) --dist loadfile -q -p no:cacheprovider $(PYTEST_ARGS)

demo: deps venv jobvenv spank
	$(PY) examples/demo.py

bench: deps venv jobvenv spank
	$(PY) bench/run_all.py

clean:
	$(MAKE) -C slurm_spank clean
	rm -rf $(VENV) .deps.stamp
