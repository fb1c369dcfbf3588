# Two commands on a fresh clone: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is installed before the project so that pip takes the CPU wheel on this machine; an
# unpinned torch pulls a multi-GB CUDA build. GPU users override it, e.g.
#   TORCH_SPEC="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124" make demo
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# the suite runs in this many processes (pytest-xdist), a file's tests in one of them (its
# module fixtures are built once): most of a test is waiting on a real service, so two fit on
# two cores; 0 runs it in this process
TEST_PROCESSES ?= 2
# the project's extras to install; .ci/run adds the Linux desktop ones (tray, dbus), which
# build from source against system packages, and ray (the Ray executor's tests) — `make demo`
# never needs them
EXTRAS ?= test
comma := ,
INSTALLED := $(VENV)/.installed-$(subst $(comma),+,$(EXTRAS))

.PHONY: demo test docs lint soak mutants install bench $(addprefix bench-,$(BENCHES)) clean \
	base wheelhouse image image-test

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
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

# ruff's lint rules and its format check, and mypy (configured in pyproject.toml: strict on
# the queue's core and the worker interface, lenient elsewhere)
LINT_EXTRAS := $(if $(filter lint,$(subst $(comma), ,$(EXTRAS))),$(EXTRAS),$(EXTRAS),lint)
lint:
	$(MAKE) install EXTRAS=$(LINT_EXTRAS)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy

# the manual (docs/, mkdocs.yml) into site/; --strict: a broken link or anchor, a page outside
# the nav or a reference page the code cannot generate fails the build
DOCS_EXTRAS := $(if $(filter docs,$(subst $(comma), ,$(EXTRAS))),$(EXTRAS),$(EXTRAS),docs)
docs:
	$(MAKE) install EXTRAS=$(DOCS_EXTRAS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# the model-based seams test (tests/seams/test_model_based.py) for an hour: its written
# sequences, then long random sequences of every rule (sidecars, uploads, held and killed
# processes too), a new seed per round (each printed; STEMDECK_MODEL_SEED=N replays one);
# SOAK_SECONDS changes how long; then the kill test with 20 kills and a minute's randomised
# afternoon (the suite runs 8 kills and 20 s)
SOAK_SECONDS ?= 3600
soak: install
	STEMDECK_SOAK=1 STEMDECK_SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/python -m pytest -s -x \
		-p no:cacheprovider tests/seams/test_model_based.py $(PYTEST_ARGS)
	STEMDECK_KILLS=20 STEMDECK_STRESS_SECONDS=60 $(BIN)/python -m pytest -s -x \
		-p no:cacheprovider tests/service/test_kill.py tests/service/test_stress.py $(PYTEST_ARGS)

# the seams test measured by mutation: each tests/seams/mutants/NAME.patch puts back one
# defect fixed before, in a copy of this working tree in a temporary folder (the checkout is
# never touched); the model-based test runs there as `make test` runs it, one mutant at a
# time, and a table says which it kills. The tree without a patch runs first and must pass.
# MUTANTS="NAME …" runs some of them; MUTANT_LIMIT is each run's limit in seconds
MUTANTS ?=
MUTANT_LIMIT ?= 900
mutants: install
	$(BIN)/python tests/seams/mutate.py --limit $(MUTANT_LIMIT) $(MUTANTS)

# every benchmark is benchmarks/bench_NAME.py, run by `make bench-NAME` (hyphens for
# underscores: bench-work-beside); BENCH_ARGS go to it, e.g. BENCH_ARGS="--runs 3".
# `make bench` runs them all but the Ray one, which needs the ray extra (BENCH_EXTRAS_ray).
BENCHES := $(subst _,-,$(patsubst benchmarks/bench_%.py,%,$(wildcard benchmarks/bench_*.py)))
BENCH_ARGS ?=
BENCH_EXTRAS_ray := ray

bench: $(addprefix bench-,$(filter-out ray,$(BENCHES)))

bench-%:
	$(MAKE) install EXTRAS=$(EXTRAS)$(if $(BENCH_EXTRAS_$*),$(comma)$(BENCH_EXTRAS_$*))
	$(BIN)/python benchmarks/bench_$(subst -,_,$*).py $(BENCH_ARGS)

# The container image (Containerfile, docs/guide/nas.md), built with buildah, no daemon:
# the base (BASE; a localhost/ name is made here with mmdebstrap when missing, any other is
# pulled), the wheelhouse (the project and every dependency as wheels, torch per TORCH_SPEC),
# then the image; its layers are cached, so a rebuild after a code change reinstalls only the
# project. `make image-test` runs the image's entrypoint on a song (tests/container/).
IMAGE ?= localhost/stemdeck-watch:latest
BASE ?= localhost/stemdeck-base:bookworm
WHEELHOUSE ?= build/wheelhouse
BUILDAH ?= buildah
BASE_PATH := /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# what the base holds (openssl: the page's self-signed certificate); a local base made with
# another list is made again
BASE_PACKAGES := python3,python3-venv,tzdata,ca-certificates,openssl
BASE_LABEL := io.stemdeck.packages

base:
	@if [ -z "$(filter localhost/%,$(BASE))" ] \
			&& $(BUILDAH) inspect --type image $(BASE) >/dev/null 2>&1; then \
		echo "base $(BASE): there"; \
	elif [ "$(filter localhost/%,$(BASE))" ] && [ "$$($(BUILDAH) inspect --type image \
			--format '{{index .OCIv1.Config.Labels "$(BASE_LABEL)"}}' $(BASE) 2>/dev/null)" \
			= "$(BASE_PACKAGES)" ]; then \
		echo "base $(BASE): there"; \
	elif [ "$(filter localhost/%,$(BASE))" ]; then \
		mkdir -p build && rm -f build/base.tar && \
		mmdebstrap --quiet --variant=minbase --include=$(BASE_PACKAGES) \
			bookworm build/base.tar && \
		container=$$($(BUILDAH) from scratch) && \
		$(BUILDAH) add --quiet $$container build/base.tar / && \
		$(BUILDAH) config --env PATH=$(BASE_PATH) --cmd /bin/sh \
			--label $(BASE_LABEL)=$(BASE_PACKAGES) $$container && \
		$(BUILDAH) commit --quiet --rm $$container $(BASE) && rm -f build/base.tar; \
	else \
		$(BUILDAH) pull $(BASE); \
	fi

# the project's wheel in project/, the rest in dependencies/, replaced only when the set of
# wheels changes (the image's dependency layer stays cached). torch first, on its own: a
# TORCH_SPEC with its own --index-url (a CUDA build) must not become the index of the rest,
# and the rest must take that very wheel, not a newer torch from PyPI

wheelhouse: $(VENV)/.torch
	rm -rf $(WHEELHOUSE)/.new && mkdir -p $(WHEELHOUSE)/.new $(WHEELHOUSE)/project
	$(BIN)/python -m pip wheel --quiet --wheel-dir $(WHEELHOUSE)/.new $(TORCH_SPEC)
	$(BIN)/python -m pip wheel --quiet --wheel-dir $(WHEELHOUSE)/.new \
		--find-links $(WHEELHOUSE)/.new . $(WHEELHOUSE)/.new/torch-*.whl
	rm -f $(WHEELHOUSE)/project/*.whl
	mv $(WHEELHOUSE)/.new/stemdeck_watch-*.whl $(WHEELHOUSE)/project/
	if [ "$$(ls $(WHEELHOUSE)/.new)" != "$$(ls $(WHEELHOUSE)/dependencies 2>/dev/null)" ]; then \
		rm -rf $(WHEELHOUSE)/dependencies && mv $(WHEELHOUSE)/.new $(WHEELHOUSE)/dependencies; \
	fi
	rm -rf $(WHEELHOUSE)/.new

image: base wheelhouse
	$(BUILDAH) bud --quiet --isolation chroot --layers --format docker \
		--build-arg BASE=$(BASE) --build-arg WHEELHOUSE=$(WHEELHOUSE) -f Containerfile -t $(IMAGE) .
	$(BUILDAH) images --format '{{.Name}}:{{.Tag}} {{.Size}}' $(IMAGE)

image-test: image install
	STEMDECK_IMAGE=$(IMAGE) $(BIN)/python -m pytest -n 0 -p no:cacheprovider tests/container \
		$(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
