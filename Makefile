# gyges: every target does its own set-up on a fresh machine (a .venv with pinned packages).
PYTHON := .venv/bin/python
SAN_FLAGS := -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -Icsrc
CORE_SOURCES := $(shell find csrc -name '*.c' -not -path 'csrc/python/*')

.PHONY: demo test build ctest pytest bench clean

demo: build
	$(PYTHON) -m gyges.demo

test: build ctest pytest

build: .venv/.installed
	$(PYTHON) setup.py -q build_ext --inplace -j 2

.venv/.installed: requirements.txt
	python3 -m venv .venv && .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt && touch $@

# The C core under AddressSanitizer and UndefinedBehaviorSanitizer, with our own C test runner.
ctest: build/ctest_san
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 build/ctest_san

build/ctest_san: $(CORE_SOURCES) $(wildcard tests/c/*.c tests/c/*.h csrc/*/*.h)
	mkdir -p build && cc $(SAN_FLAGS) $(CORE_SOURCES) tests/c/*.c -o $@ -lm -ldl -lpthread

pytest: build
	$(PYTHON) -m pytest -q tests

bench: build
	$(PYTHON) benchmarks/run_all.py

clean:
	rm -rf build gyges/*.so .pytest_cache
