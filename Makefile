# The two entry points of the README: `make demo` and `make test`.
# Both build .venv first. torch is pinned exactly (a local CPU wheel on these
# machines) and installed BEFORE nixl, which otherwise pulls CUDA packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test docs bench clean

$(STAMP): pyproject.toml setup.py Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,monitor,ray]'
	$(BIN)/pip install -q nixl==1.5.1
	touch $(STAMP)

# The C copy loop and the C++ check loops are compiled by the install; a
# checkout whose _memcpy.c, _diff.c or _ptrs.cpp changed since (git pull) rebuilds
# them here, without reinstalling the rest.
EXT := $(VENV)/.memcpy-built
$(EXT): $(STAMP) src/tensorferry/copy/_memcpy.c src/tensorferry/plans/_diff.c src/tensorferry/tensors/_ptrs.cpp
	$(BIN)/pip install -q --no-deps -e .
	touch $(EXT)

# vLLM 0.33 for tests/vllm and benchmarks/bench_vllm.py. Its metadata pins a
# CUDA build of torch 2.14, so pip never resolves vLLM's own dependencies:
# vllm goes in with --no-deps, then the pure-Python packages its import
# chain needs (the `vllm` extra), all under constraints that keep every
# version installed above (torch==2.13.0 included). Tolerant: where it
# fails, the vLLM tests skip with the import error as their reason.
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_CONSTRAINTS := $(VENV)/constraints-vllm.txt
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip freeze --exclude-editable | grep -v ' @ ' > $(VLLM_CONSTRAINTS)
	echo 'torch==2.13.0' >> $(VLLM_CONSTRAINTS)
	-$(BIN)/pip install -q --no-deps -c $(VLLM_CONSTRAINTS) vllm==0.33.0 && \
		$(BIN)/pip install -q -c $(VLLM_CONSTRAINTS) -e '.[vllm]'
	touch $(VLLM_STAMP)

venv: $(EXT)

demo: $(EXT)
	UCX_NET_DEVICES=lo $(BIN)/tensorferry demo

# The test run includes the docs: tests/docs builds the site strictly (as
# `make docs` does) and runs every python block of README.md and docs/.
test: $(EXT) $(VLLM_STAMP)
	UCX_NET_DEVICES=lo GLOO_SOCKET_IFNAME=lo $(BIN)/python -m pytest -q

# The documentation site (mkdocs.yml), strict: a broken link, anchor or
# API reference fails it. Output in build/site/; `mkdocs serve` to browse.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# bench_transfer.py runs the transfer benchmarks (bench_transports, bench_peers,
# bench_stream, bench_plans) in one pair of processes; interleave.py compares
# two checkouts (see docs/architecture.md, "Tests and benchmarks").
bench: $(EXT)
	UCX_NET_DEVICES=lo $(BIN)/python benchmarks/bench_copy.py
	UCX_NET_DEVICES=lo $(BIN)/python benchmarks/bench_pool.py
	UCX_NET_DEVICES=lo $(BIN)/python benchmarks/bench_transfer.py
	UCX_NET_DEVICES=lo GLOO_SOCKET_IFNAME=lo $(BIN)/python benchmarks/bench_ray.py
	$(BIN)/python benchmarks/bench_monitor.py

clean:
	rm -rf $(VENV)
