# gyges: every target does its own set-up on a fresh machine (a .venv with pinned packages).
PYTHON := .venv/bin/python
SAN_FLAGS := -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -Icsrc
CORE_SOURCES := $(shell find csrc -name '*.c' -not -path 'csrc/python/*')

.PHONY: demo test build ctest tsan cudaemu pytest bench clean

demo: build
	$(PYTHON) -m gyges.demo

test: build ctest tsan cudaemu pytest

build: .venv/.installed
	$(PYTHON) setup.py -q build_ext --inplace -j 2

.venv/.installed: requirements.txt
	python3 -m venv .venv && .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt && touch $@

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

# The CUDA forward pass and the d2d communicator, unchanged, on an emulated device (host memory,
# naive kernels and GEMM, synchronous streams) against the CPU pass: how their plumbing is checked
# on machines without a GPU (tests/cuda_emu/harness.c).
EMU_CC := cc $(SAN_FLAGS) -Itests/cuda_emu -DGY_WITH_CUDA=1
EMU_AS_CUDA := -Dgy_arena_backend=emu_arena_backend -Dgy_arena_device=emu_arena_device
EMU_BUILT := csrc/engine/forward_cuda.c csrc/comm/comm_d2d.c csrc/comm/comm_stream.c \
             csrc/kernels/kv_copy_device.c

# Then the whole extension built with CUDA on that device and a pretend driver
# (tests/cuda_emu/build_ext.py), under the Python tests that otherwise need a GPU. The GEMM
# refusal test checks gemm.cu's own messages, which the emulated GEMM does not have.
EMU_EXT := build/cuda_emu_ext
EMU_ENV := GYGES_CUDA_EMULATED=1 GYGES_NCCL_LIBRARY=/nonexistent LD_LIBRARY_PATH=$(EMU_EXT)/lib PYTHONPATH=$(EMU_EXT)

cudaemu: build/cuda_emu .venv/.installed
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 build/cuda_emu
	$(PYTHON) tests/cuda_emu/build_ext.py $(EMU_EXT)
	$(EMU_ENV) .venv/bin/pytest -q -p no:cacheprovider tests/test_cuda_host.py tests/test_cuda_engine.py --deselect tests/test_cuda_engine.py::test_gemm_refuses_bad_shapes_before_the_device

build/cuda_emu: $(CORE_SOURCES) $(wildcard tests/cuda_emu/*) $(wildcard csrc/*/*.h)
	mkdir -p build/emu && $(EMU_CC) -DGY_WITH_CUDA_FORWARD=1 $(EMU_AS_CUDA) -c csrc/engine/forward_cuda.c -o build/emu/forward_cuda.o && $(EMU_CC) $(EMU_AS_CUDA) -Dgy_kv_copy_heads=emu_device_kv_copy_heads -c csrc/kv/kv_copy.c -o build/emu/kv_copy_device.o && $(EMU_CC) $(EMU_AS_CUDA) -c csrc/kernels/kv_copy_device.c -o build/emu/kv_copy_heads_device.o && $(EMU_CC) -c csrc/comm/comm_d2d.c -o build/emu/comm_d2d.o && $(EMU_CC) -c csrc/comm/comm_stream.c -o build/emu/comm_stream.o && $(EMU_CC) -c tests/cuda_emu/emu.c -o build/emu/emu.o && $(EMU_CC) -c tests/cuda_emu/emu_device.c -o build/emu/emu_device.o && cc $(SAN_FLAGS) $(filter-out $(EMU_BUILT),$(CORE_SOURCES)) tests/cuda_emu/harness.c build/emu/*.o -o $@ -lm -ldl -lpthread

pytest: build
	$(PYTHON) -m pytest -q tests

bench: build
	$(PYTHON) benchmarks/run_all.py

clean:
	rm -rf build gyges/*.so .pytest_cache
