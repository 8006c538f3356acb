"""Device-side execution: the jitted model step and the token sampler that runs inside it."""
