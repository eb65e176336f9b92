# The two commands of README's quick start, over a virtual environment in .venv:
#   make demo   creates .venv, installs the package with its flax and test extras (building the
#               native extension when nvcc is found), prints what was installed, runs the example
#   make test   the test suite against the installed package (installing it first if needed)
#   make gpu-check  on an NVIDIA GPU machine: builds this checkout for the local card into $(PYTHON)
#               (no virtual environment), runs the GPU suite, the benchmarks and the example, and
#               writes benchmarks/results/*_<card>.json (benchmarks/gpu_check.py): every GPU number
#               in README, in about 10 minutes on an H100 or H200
# PYTHON picks the interpreter (3.11 or newer); EXTRAS the package's extras (add sm100 for the
# B200/B300 kernels' cubins); JAX_SPARSE_MLA_CUDA=ON|OFF forces or skips the native build (default
# AUTO: when nvcc is found).
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= flax,test
PIP_FLAGS ?= --quiet --disable-pip-version-check

# Reinstall whenever the package, its native sources or its build files change.
SOURCES := pyproject.toml $(shell find jax_sparse_mla ffi build_backend -type f \
             -not -name '*.pyc' -not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: demo test install clean gpu-check

# -P and the pytest script (not `python -m pytest`): the checkout's folder stays off sys.path, so the
# installed package (with its compiled extension) is the one imported, not the source tree.
demo: $(VENV)/.installed
	$(VENV)/bin/python -P -m jax_sparse_mla
	$(VENV)/bin/python examples/generate.py

test: $(VENV)/.installed
	$(VENV)/bin/pytest

install: $(VENV)/.installed

gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out benchmarks/results

$(VENV)/.installed: $(SOURCES)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) ".[$(EXTRAS)]"
	touch $@

clean:
	rm -rf $(VENV) build
