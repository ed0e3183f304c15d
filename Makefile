# hicache developer entry points. `make bench` and `make test` each set up .venv/ first.
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM has its own venv (integrations/vllm/setup-dev.sh): its torch/transformers pins stay out of .venv.
VLLM_VENV := .venv-vllm

.PHONY: setup bench test lint typecheck unit vllm

setup:
	bash scripts/setup.sh

# `hicache bench` (a model's pages through the file backend vs raw I/O), then the file backend's
# two layouts from disk: durable backup, cold and warm prefetch next to the raw O_DIRECT limit.
bench: setup
	$(VENV)/bin/hicache bench
	$(PY) benchmarks/bench_file.py --quick

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck:
	$(VENV)/bin/mypy hicache_core
	$(VENV)/bin/mypy plugins/file/hicache_file plugins/mooncake/hicache_mooncake plugins/hf3fs_stub/hicache_hf3fs_stub plugins/nixl/hicache_nixl integrations/sglang/hicache_sglang integrations/vllm/hicache_vllm

unit:
	$(PY) -m pytest tests -q --ignore=tests/vllm -n 3 --dist loadgroup --no-loadscope-reorder

vllm:
	bash integrations/vllm/setup-dev.sh
	$(VLLM_VENV)/bin/python -m pytest tests/vllm -q

# vLLM's venv and tests (`make vllm`), and lint and typecheck, run in the background while the
# main suite runs (mypy uses one core; the suite's longest groups mostly wait on processes they
# started); their output follows the suite's, and any of them failing fails `make test`.
test: setup
	@mkdir -p build
	@$(MAKE) --no-print-directory vllm >build/vllm-tests.log 2>&1 & vllm=$$!; \
	$(MAKE) --no-print-directory lint typecheck >build/lint-typecheck.log 2>&1 & static=$$!; \
	$(MAKE) --no-print-directory unit; rc=$$?; \
	wait $$static; src=$$?; \
	echo "--- make lint typecheck (exit $$src) ---"; cat build/lint-typecheck.log; \
	wait $$vllm; vrc=$$?; \
	echo "--- make vllm (exit $$vrc) ---"; cat build/vllm-tests.log; \
	test $$rc = 0 && test $$src = 0 && test $$vrc = 0
