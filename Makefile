# The one command surface of kvroute. Python tooling lives in .venv (created by `make dev`), so a
# clean clone needs only python3 (>= 3.11), a Rust toolchain and network access to PyPI/crates.io.
.DEFAULT_GOAL := help
SHELL := bash

VENV ?= .venv
PY := $(VENV)/bin/python
# maturin installs into the environment named by VIRTUAL_ENV.
MATURIN := VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin
PYSRC := python/kvroute tests benches

.PHONY: help install dev fmt lint test test-rust test-python bench ci

help:
	@echo "make install   pip install . (into the current environment)"
	@echo "make dev       create/refresh $(VENV): maturin, test extras, release build of the extension"
	@echo "make fmt       format Rust and Python sources"
	@echo "make lint      rustfmt, clippy, ruff, mypy --strict, stubtest"
	@echo "make test      Rust tests (nextest, or cargo test) and pytest"
	@echo "make bench     criterion benches of the core"
	@echo "make ci        lint + test"

install:
	pip install .

# The venv's tools are reinstalled only when pyproject.toml changes; the extension is rebuilt
# (incrementally) on every call.
$(VENV)/.tools: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 'maturin>=1.7,<2'
	touch $@

dev: $(VENV)/.tools
	$(MATURIN) develop --release --extras test

fmt: $(VENV)/.tools
	cargo fmt --all
	$(PY) -m ruff format $(PYSRC)
	$(PY) -m ruff check --fix $(PYSRC)

lint: dev
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PY) -m ruff format --check $(PYSRC)
	$(PY) -m ruff check $(PYSRC)
	$(PY) -m mypy
	$(PY) -m mypy.stubtest kvroute._native

test-rust:
	if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --workspace; \
	else \
		cargo test --workspace; \
	fi

test-python: dev
	$(PY) -m pytest

test: test-rust test-python

bench:
	cargo bench -p kvroute-core

ci: lint test
