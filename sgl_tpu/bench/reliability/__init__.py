"""The reliability campaign: load, disconnects and aborts, KV exhaustion, a killed child process
and property-based fuzzing of every route's body, each followed by the invariants of
`invariants.py`. `tests/test_reliability*.py` run it at CI size; `python -m
sgl_tpu.bench.reliability` runs the long version (needs the `test` extra: hypothesis, aiohttp).
"""
