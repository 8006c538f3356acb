"""The neutral side of execution: the step contract (`step.py`), the backend registry and the
resolution of every runner setting (`registry.py`, asking each backend's platform module), the
decode-row bookkeeping and deterministic mode's rules. The runners live in their backends'
homes (sgl_tpu/backends/jax, sgl_tpu/backends/torch).

OpenMP threads' waiting is set here (`omp_wait.py`), before any runner imports torch: libgomp
reads it once, when torch first loads.
"""

from sgl_tpu.executor.omp_wait import configure as _configure_omp_wait

_configure_omp_wait()
