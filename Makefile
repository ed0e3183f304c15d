# hicache developer entry points. `make bench` and `make test` each set up .venv/ first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup bench test lint typecheck unit

setup:
	bash scripts/setup.sh

bench: setup
	$(VENV)/bin/hicache bench

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck:
	$(VENV)/bin/mypy hicache_core
	$(VENV)/bin/mypy plugins/file/hicache_file plugins/mooncake/hicache_mooncake plugins/hf3fs_stub/hicache_hf3fs_stub integrations/sglang/hicache_sglang

unit:
	$(PY) -m pytest tests -q

test: setup lint typecheck unit
