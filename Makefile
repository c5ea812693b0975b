# strata's two entry points; each installs what is missing, configures, builds and runs.
#   make demo   the main job: strata-train under the default policy, then --compare
#   make test   every test that needs no GPU, the layering check, the sanitizer builds and the
#               fuzzer
BUILD       ?= build
ASAN_BUILD  ?= build-asan
TSAN_BUILD  ?= build-tsan
FUZZ_BUILD  ?= build-fuzz
FUZZ_SECONDS ?= 60
CUDACXX     ?= $(wildcard /usr/local/cuda/bin/nvcc)
export CUDACXX
CMAKE_FLAGS ?=
PYTHON      ?= python3
# The pip build of the Python package (build/python-*) compiles the same sources as $(BUILD):
# ccache serves them when paths are taken relative to the tree.
export CCACHE_BASEDIR := $(CURDIR)

.PHONY: demo test deps configure build python pytest consumer sanitize sanitize-thread fuzz \
        fault-sweep clean

deps:
	@tools/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_PYTHON=ON \
	  -DCMAKE_PREFIX_PATH="$$(tools/torch-prefix.sh)" $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD)

# strata-train under the default policy, then every policy and PyTorch's baselines side by side
# on an 8-block model whose Adam states (12.7 MiB) alone exceed the 8 MiB GPU budget, so
# parameters and gradients stream too: keep_on_gpu runs out of memory while the other policies
# train.
DEMO_DIR    ?= $(BUILD)/demo
demo: build python
	$(BUILD)/bin/strata-train
	@mkdir -p $(DEMO_DIR)
	$(BUILD)/bin/strata-train --compare --layers=8 --strata_roles=all --strata_gpu_budget=8MiB \
	  --json=$(DEMO_DIR)/compare.json --chart=$(DEMO_DIR)/compare.svg
	@echo "demo: JSON in $(DEMO_DIR)/compare.json, chart in $(DEMO_DIR)/compare.svg"
	$(PYTHON) examples/train_gpt.py --steps 8 --compare

# The Python package, installed into $(PYTHON) with pip (scikit-build-core runs CMake against the
# installed torch), then imported from outside the tree.
python: build
	tools/pip-install.sh $(PYTHON) --no-build-isolation --no-deps .
	cd /tmp && $(PYTHON) -c "import strata; print('import strata:', strata.__version__, strata.__file__)"

# The Python tests (pytest; the gpu-marked ones skip without a GPU).
pytest: python
	$(PYTHON) -m pytest -q python/tests

# strata as a CMake package: installed, then found by an outside project that trains with it.
consumer: build
	cmake --install $(BUILD) --prefix $(BUILD)/install --component dev
	cmake -S examples/cpp_consumer -B $(BUILD)/consumer -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$(CURDIR)/$(BUILD)/install;$$(tools/torch-prefix.sh)"
	cmake --build $(BUILD)/consumer
	$(BUILD)/consumer/strata_consumer

# Host-only libraries and their tests under AddressSanitizer + UndefinedBehaviorSanitizer, built
# without CUDA and LibTorch (which also proves the code builds with CUDA off).
sanitize: deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DSTRATA_WITH_CUDA=OFF -DSTRATA_WITH_TORCH=OFF -DSTRATA_BUILD_BENCHMARKS=OFF \
	  -DSTRATA_BUILD_APPS=OFF -DSTRATA_SANITIZE=address,undefined
	cmake --build $(ASAN_BUILD)
	ctest --test-dir $(ASAN_BUILD) -LE gpu --output-on-failure

# The same with ThreadSanitizer (the threaded suites: pools, L3, the runtime's locks).
sanitize-thread: deps
	cmake -S . -B $(TSAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DSTRATA_WITH_CUDA=OFF -DSTRATA_WITH_TORCH=OFF -DSTRATA_BUILD_BENCHMARKS=OFF \
	  -DSTRATA_BUILD_APPS=OFF -DSTRATA_SANITIZE=thread
	cmake --build $(TSAN_BUILD)
	ctest --test-dir $(TSAN_BUILD) -LE gpu --output-on-failure

# The libFuzzer targets (clang, ASan + UBSan, libraries instrumented for coverage): the allocator
# and registry, and Adam::load over checkpoint files. For each, the kept regression inputs first,
# then FUZZ_SECONDS of fuzzing. A crashing input is written to $(FUZZ_BUILD)/; copy it into the
# target's regressions folder once fixed.
fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DSTRATA_WITH_CUDA=OFF -DSTRATA_WITH_TORCH=OFF -DSTRATA_BUILD_TESTS=OFF \
	  -DSTRATA_BUILD_BENCHMARKS=OFF -DSTRATA_BUILD_APPS=OFF -DSTRATA_FUZZ=ON \
	  -DSTRATA_SANITIZE=address,undefined -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link
	cmake --build $(FUZZ_BUILD) --target registry_fuzzer adam_load_fuzzer
	$(FUZZ_BUILD)/bin/registry_fuzzer -runs=0 tests/fuzz/regressions
	$(FUZZ_BUILD)/bin/adam_load_fuzzer -runs=0 tests/fuzz/adam_load_regressions
	@mkdir -p $(FUZZ_BUILD)/corpus $(FUZZ_BUILD)/adam_corpus
	cd $(FUZZ_BUILD) && bin/registry_fuzzer corpus ../tests/fuzz/regressions \
	  -max_total_time=$(FUZZ_SECONDS) -timeout=60 -print_final_stats=1
	cd $(FUZZ_BUILD) && bin/adam_load_fuzzer adam_corpus ../tests/fuzz/adam_load_regressions \
	  -max_total_time=$(FUZZ_SECONDS) -timeout=60 -print_final_stats=1

# The fault sweep with every k of every site (make test runs a seeded sample of it); the GPU
# script runs it too.
fault-sweep: build
	STRATA_FAULT_EXHAUSTIVE=1 $(BUILD)/bin/reliability_fault_sweep_test

test: build
	tools/check_layering.sh --self-test
	tools/check_layering.sh
	python3 tools/check_notes.py --self-test
	python3 tools/check_notes.py
	ctest --test-dir $(BUILD) -LE gpu --output-on-failure
	@grep -h -E "^(fault sweep seed|fault sites:|Adam step faults:|overlapped step faults:|failed finish_step then cancel_step:|bad inputs tried:)" $(BUILD)/Testing/Temporary/LastTest.log
	$(MAKE) --no-print-directory pytest
	$(MAKE) --no-print-directory consumer
	$(MAKE) --no-print-directory sanitize
	$(MAKE) --no-print-directory sanitize-thread
	$(MAKE) --no-print-directory fuzz

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD)
