# fsdp.cpp: `make test` and `make demo` set up a fresh Debian 12 machine, build, and run.
BUILD ?= build
BUILD_TYPE ?= Release
CTEST_JOBS ?= 2

.PHONY: all setup configure build test demo clean

all: build

setup:
	./scripts/setup.sh

configure: setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(CTEST_JOBS)

demo: build
	./scripts/demo.sh $(BUILD)

clean:
	rm -rf $(BUILD)
