"""Device-side execution: the step contract (`step.py`), the backend registry (`registry.py`)
and the two runners with their samplers (`jax/`, `torch/`).

OpenMP threads' waiting is set here (`omp_wait.py`), before any runner imports torch: libgomp
reads it once, when torch first loads.
"""

from sgl_tpu.executor.omp_wait import configure as _configure_omp_wait

_configure_omp_wait()
