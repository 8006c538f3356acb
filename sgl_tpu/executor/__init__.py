"""Device-side execution: the step contract (`step.py`), the backend registry (`registry.py`)
and the two runners with their samplers (`jax/`, `torch/`).

OpenMP threads that spin while waiting stall badly when another process holds a core (a torch
decode step measured 9x slower with 2 spinning threads on a busy 2-core machine, 1.1x with
passive waiting); passive waiting costs little on an idle machine. OpenMP reads this once, when
torch first loads, so it is set here, before any runner imports torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
