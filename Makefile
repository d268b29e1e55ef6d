# torchpass developer entry points. Both `make demo` and `make test` install
# what is missing (apt packages, the virtualenv, the SPANK plugin) and are
# idempotent; run them as root on Debian 12 or 13.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
WHEELS := $(wildcard /opt/wheels)
PIP_FIND_LINKS_FLAG := $(if $(WHEELS),--find-links $(WHEELS),)
PYTEST_ARGS ?=

.PHONY: all deps venv spank lint-imports test unit integration demo bench clean

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

spank: deps
	$(MAKE) -C slurm_spank

unit: venv
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

integration: deps venv spank
	$(PY) -m pytest tests/integration -q $(PYTEST_ARGS)

# Which package may import which: the contracts in pyproject.toml [tool.importlinter].
lint-imports: venv
	$(VENV)/bin/lint-imports --no-cache

test: deps venv spank lint-imports
	$(PY) -m pytest tests/unit tests/integration -q -p no:cacheprovider $(PYTEST_ARGS)

demo: deps venv spank
	$(PY) examples/demo.py

bench: deps venv spank
	$(PY) bench/run_all.py

clean:
	$(MAKE) -C slurm_spank clean
	rm -rf $(VENV) .deps.stamp
