"""Device-side execution: the model runners of both backends (executor/runner.py) and their
samplers.

OpenMP threads that spin while waiting stall badly when another process holds a core (a torch
decode step measured 9x slower with 2 spinning threads on a busy 2-core machine, 1.1x with
passive waiting); passive waiting costs little on an idle machine. OpenMP reads this once, when
torch first loads, so it is set here, before any runner imports torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
