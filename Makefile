# Two entry points on a fresh machine: `make demo` and `make test`. Each installs
# what it needs (Debian libraries, a virtual environment with pinned versions) and
# is safe to run again.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The transfer engine's CUDA wheel fails to import without libcudart and a driver,
# so only hosts that have both get it.
MOONCAKE_EXTRA := $(shell if command -v nvidia-smi >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q libcudart; then echo mooncake; else echo mooncake-cpu; fi)
STAMP := $(VENV)/.installed-$(MOONCAKE_EXTRA)
APT_PACKAGES := libibverbs1 libnuma1 etcd-server iproute2
PYTEST_ARGS ?=

.PHONY: demo bench soak test test-py310 deps system-deps schema clean

demo: deps
	$(VENV)/bin/pdxfer demo

# wire vs raw transfer engines vs pdxfer on loopback; a few minutes (`pdxfer bench --help`)
bench: deps
	$(VENV)/bin/pdxfer bench

# minutes of rooms with every fault mixed in (`pdxfer soak --help`); not part of `make test`
SOAK_MINUTES ?= 5
soak: deps
	$(VENV)/bin/pdxfer soak --minutes $(SOAK_MINUTES)

test: deps
	$(PY) -m pytest $(PYTEST_ARGS)

# Python 3.10, the Python of many engine images: an import of every module and the
# config tests, in a virtual environment of its own (unpinned: the pinned numpy needs
# 3.11). Needs a python3.10 (pyenv's, or Debian's/deadsnakes' python3.10).
PYTHON310 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))
VENV310 ?= .venv310
test-py310:
	test -x $(VENV310)/bin/python || $(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q -e . pytest==9.2.0
	$(VENV310)/bin/python -c "import importlib, pkgutil, pdxfer; mods = [m.name for m in pkgutil.walk_packages(pdxfer.__path__, 'pdxfer.') if not m.name.endswith('__main__')]; [importlib.import_module(m) for m in mods]; print(len(mods), 'modules import on', __import__('sys').version.split()[0])"
	$(VENV310)/bin/python -m pytest -q -p no:cacheprovider tests/test_config.py

deps: $(STAMP)

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml requirements/pins.txt | system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c requirements/pins.txt -e '.[$(MOONCAKE_EXTRA),torch,test]'
	rm -f $(VENV)/.installed-*
	touch $@

# Regenerate proto/schema.json from pdxfer/core/protocol.py (a test fails when they drift).
schema: deps
	$(PY) -m pdxfer.core.protocol > proto/schema.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
