# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tilework-installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Only when no torch is importable: 2.13.0's CPU build lies on this machine's disk, while an
	# unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,models]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tilework demo

# The lint first (seconds): pyflakes, pycodestyle errors, import order, 100 columns
# (pyproject's [tool.ruff]). pytest's exit code 5 ("no tests collected") is a failure too.
# The slowest tests are listed at the end: the suite must stay well under 15 minutes here.
test: lint
	$(PY) -m pytest --durations=15; rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests" >&2; \
	[ $$rc -eq 0 ]

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
