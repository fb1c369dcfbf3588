# Two commands on a fresh clone: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is installed before the project so that pip takes the CPU wheel on this machine; an
# unpinned torch pulls a multi-GB CUDA build. GPU users override it, e.g.
#   TORCH_SPEC="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124" make demo
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# the project's extras to install; .ci/run adds the Linux desktop ones (tray, dbus), which
# build from source against system packages, and ray (the Ray executor's tests) — `make demo`
# never needs them
EXTRAS ?= test
comma := ,
INSTALLED := $(VENV)/.installed-$(subst $(comma),+,$(EXTRAS))

.PHONY: demo test docs soak install bench bench-memory bench-intake bench-control bench-links bench-notify bench-restore bench-output bench-precision bench-work-beside bench-ray clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	touch $@

$(INSTALLED): pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

install: $(INSTALLED)

demo: install
	$(BIN)/stemdeck-watch demo

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the manual (docs/, mkdocs.yml) into site/; --strict: a broken link or anchor, a page outside
# the nav or a reference page the code cannot generate fails the build
DOCS_EXTRAS := $(if $(filter docs,$(subst $(comma), ,$(EXTRAS))),$(EXTRAS),$(EXTRAS),docs)
docs:
	$(MAKE) install EXTRAS=$(DOCS_EXTRAS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# the model-based seams test (tests/test_model_based.py) for an hour: long random sequences,
# a new seed per round (each printed; STEMDECK_MODEL_SEED=N replays one); SOAK_SECONDS changes
# how long
SOAK_SECONDS ?= 3600
soak: install
	STEMDECK_SOAK=1 STEMDECK_SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/python -m pytest -s -x \
		-p no:cacheprovider tests/test_model_based.py $(PYTEST_ARGS)

bench: install
	$(BIN)/python benchmarks/bench_throughput.py
	$(BIN)/python benchmarks/bench_control.py
	$(BIN)/python benchmarks/bench_links.py
	$(BIN)/python benchmarks/bench_notify.py
	$(BIN)/python benchmarks/bench_restore.py
	$(BIN)/python benchmarks/bench_intake.py
	$(BIN)/python benchmarks/bench_memory.py
	$(BIN)/python benchmarks/bench_output.py
	$(BIN)/python benchmarks/bench_precision.py
	$(BIN)/python benchmarks/bench_work_beside.py

bench-memory: install
	$(BIN)/python benchmarks/bench_memory.py

bench-intake: install
	$(BIN)/python benchmarks/bench_intake.py

bench-control: install
	$(BIN)/python benchmarks/bench_control.py

bench-links: install
	$(BIN)/python benchmarks/bench_links.py

bench-notify: install
	$(BIN)/python benchmarks/bench_notify.py

bench-restore: install
	$(BIN)/python benchmarks/bench_restore.py

bench-output: install
	$(BIN)/python benchmarks/bench_output.py

bench-precision: install
	$(BIN)/python benchmarks/bench_precision.py

# decode ahead / publish behind on against off, alternating (issue #13)
bench-work-beside: install
	$(BIN)/python benchmarks/bench_work_beside.py

# the Ray executor against the local worker (needs the ray extra)
bench-ray:
	$(MAKE) install EXTRAS=$(EXTRAS),ray
	$(BIN)/python benchmarks/bench_ray.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
