# fsdp.cpp: `make test` and `make demo` set up a fresh Debian 12 machine, build, and run.
BUILD ?= build
BUILD_TYPE ?= Release
CTEST_JOBS ?= 2

.PHONY: all setup configure build test demo clean libtorch2-chroot libtorch2-chroot-start sanitize fuzz \
  cuda-check bench

all: build

setup:
	./scripts/setup.sh

# clang by default: with the precompiled libtorch header it instantiates libtorch's templates once
# instead of in every file, which makes a fresh build about 3x faster than GCC (CMakeLists.txt,
# FSDP_PCH). `make FSDP_CXX=g++ FSDP_CC=gcc BUILD=build-gcc test` builds with GCC. The compiler is
# fixed when BUILD is first configured.
FSDP_CXX ?= clang++
FSDP_CC ?= clang

configure: setup
	CC=$(FSDP_CC) CXX=$(FSDP_CXX) cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD)

# As root, `make test` first starts setting up the libtorch 2.6 chroot in the background (a
# download: it runs while the project builds), for the tests that need PyTorch 2.6; the suite's
# fixture libtorch2_chroot waits for it. Not as root, those tests skip, saying why (on CI,
# which runs as root, they fail instead). docs/testing.md has what runs where, and the times.
test: libtorch2-chroot-start build
	cd $(BUILD) && ctest --output-on-failure -j $(CTEST_JOBS)

libtorch2-chroot-start: setup
	./scripts/libtorch2-chroot.sh start

# The suite under AddressSanitizer + UndefinedBehaviorSanitizer, built with Debian's clang
# (docs/testing.md, "Sanitizers": options and suppressions, each with its reason). libtorch
# itself is not instrumented.
# The tests that build programs against the installed package (example_find_package, the docs'
# blocks and commands) get the same compiler and flags, or the instrumented libfsdp.a cannot link.
# real_torchrun and real_torchrun_build are left out: they build and run fsdp-train against
# libtorch 2.6 inside the chroot with the chroot's clang, so nothing they run is instrumented.
SANITIZE_BUILD ?= build-asan
SAN_DIR := $(CURDIR)/tests/sanitizers
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined
sanitize: setup
	./scripts/setup-fuzz.sh
	CC=clang CXX=clang++ cmake -S . -B $(SANITIZE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DFSDP_SANITIZE=address,undefined -DFSDP_BUILD_BENCH=OFF
	cmake --build $(SANITIZE_BUILD)
	cd $(SANITIZE_BUILD) && \
	  CC=clang CXX=clang++ CXXFLAGS="$(SAN_FLAGS)" LDFLAGS="$(SAN_FLAGS)" \
	  FSDP_TEST_TIME_SCALE=3 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  LSAN_OPTIONS=suppressions=$(SAN_DIR)/lsan.supp:print_suppressions=0 \
	  UBSAN_OPTIONS=suppressions=$(SAN_DIR)/ubsan.supp:print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(CTEST_JOBS) -E '^real_torchrun'

# libFuzzer targets (tests/fuzz) built with Debian's clang, run 20 s each from the seed corpus.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 20
fuzz: setup
	./scripts/setup-fuzz.sh
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DFSDP_FUZZ=ON -DFSDP_SANITIZE=address,undefined -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_BENCH=OFF
	cmake --build $(FUZZ_BUILD) --target fuzz_mesh_strategy fuzz_cluster_env fuzz_train_options \
	  fuzz_checkpoint_meta fuzz_trace fuzz_dcp_metadata
	./tests/fuzz/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

demo: build
	./scripts/demo.sh $(BUILD)

# BENCHMARKS.md, docs/bench/*.png and docs/bench/results.json (about 15 minutes; bench/bench.py
# says what it runs). The libtorch 2.6 comparison needs `make libtorch2-chroot` first.
bench: build
	/usr/bin/python3 bench/bench.py --build $(BUILD)

clean:
	rm -rf $(BUILD)

# A Debian 13 chroot with libtorch 2.6 and torchrun 2.6 (root, a Debian mirror; ~5 min, ~2 GB):
# the real torchrun test runs there (tests/launchers/torchrun_test.sh); see the script's header.
libtorch2-chroot:
	./scripts/libtorch2-chroot.sh setup

# The CUDA/NCCL code compiled and the whole suite run against Debian 13's CUDA libtorch 2.6, no
# GPU needed (root, a Debian mirror; the first run downloads ~2.9 GB into /opt/cuda-chroot): see
# scripts/cuda-check.sh and docs/testing.md. Not part of `make test`. setup first: this machine's
# npm installs the npm package the suite needs into the chroot.
cuda-check: setup
	./scripts/cuda-check.sh all
