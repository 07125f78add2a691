# Two commands a fresh machine needs: `make run` (install + default training), `make test` (install + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-peers run test test-isa test-shm lint bench-op bench-step clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

GPU_STAMP := $(VENV)/.installed-gpu

# The tests also run the Triton kernels in triton's interpreter (the [gpu] extra, ~1 GB).
$(GPU_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,gpu]"
	touch $(GPU_STAMP)

PEERS_STAMP := $(VENV)/.installed-peers

# The peers `neorec bench op --compare fbgemm` and `bench step --compare torchrec` measure against
# (the [bench] extra, ~200 MB with scikit-learn's scipy), so their tests run instead of skipping.
# torchrec goes in with --no-deps (pins in constraints.txt; docs/performance.md): it declares
# fbgemm-gpu, the CUDA wheel, which would overwrite fbgemm-gpu-cpu's module.
TORCHREC_PEER := torchrec torchmetrics tensordict pyre-extensions typing-inspect lightning-utilities \
	cloudpickle pyvers
$(PEERS_STAMP): $(GPU_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,gpu,bench]"
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps $(TORCHREC_PEER)
	$(BIN)/python -c "import fbgemm_gpu, torchrec, sklearn"
	touch $(PEERS_STAMP)

install: $(STAMP)

install-peers: $(PEERS_STAMP)

run: $(STAMP)
	$(BIN)/neorec train $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check neorec tests
	$(BIN)/ruff format --check neorec tests
	$(BIN)/mypy

# Two workers (pytest-xdist; a file's tests stay on one worker): much of the suite waits on the
# processes its tests start. The slowest tests are listed at the end.
test: lint $(PEERS_STAMP)
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --durations=25 $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-isa

# The bitwise claims again under every other vector ISA this CPU has (AVX2, AVX-512): what
# another machine's PyTorch would run.
test-isa: $(STAMP)
	@for cap in $$($(BIN)/python tests/isa_capabilities.py); do \
	  echo "== bitwise tests under ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest tests -m bitwise -n 2 --dist loadfile $(PYTEST_ARGS) || exit 1; \
	done

# The distributed tests again with the default group's all-to-alls and all-gathers through shared
# memory (neorec.distributed.shm; ~2.5 min). Training's embedding group uses it by default.
SHM_TESTS = distributed dp_dense codecs columns sptt towers dynamic_sharded checkpoint_dist shm_transport twrw
test-shm: $(STAMP)
	NEOREC_TEST_TRANSPORT=shm $(BIN)/python -m pytest $(SHM_TESTS:%=tests/test_%.py) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info
