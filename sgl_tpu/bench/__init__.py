"""Benchmarks of sgl-tpu: six supported entry points, each printing one JSON object (and writing
it with `--output`), each comparing its arms inside one run (the machines are shared, so ratios
within a run are what hold).

Entry points (`python -m sgl_tpu.bench.<name> --help`):

    serving      two servers through HTTP: radix cache on/off (`--compare cache`) or overlap
                 scheduling on/off (`--compare overlap`), streamed from /generate
    agent_loop   agent programs (ReAct, tool calls, tree of thought, ...) against one or more
                 servers (sgl-tpu, or a peer such as llama.cpp) through their own APIs
    executor     the model runners' prefill and decode steps per backend, dtype, weight format
                 and oneDNN ISA; `--deterministic`: the cost of --enable-deterministic-inference
    structured   grammar masks' cost per token and what jump-forward saves on forced JSON
    accelerator  one command for an accelerator's table: the executor, a step profile and
                 servers with one and many streams, per backend, each part in its own process
    lowering     the JAX runner's jitted steps lowered for TPU / CUDA on this host, without the
                 chips (collectives, custom calls, buckets, bytes per chip); `--plan`: the HBM
                 plan of a report (`accelerator --lower` runs it too)

Library modules (no command of their own): `http_load` (a server as a child process, token-id
workloads, streaming clients), `step_inputs` (the executor benches' `SeqStep`s), `determinism`
(executor --deterministic), `timing` (interleaved timing loops), `report` (the JSON output).

Profilers, random checkpoints of a model's shape, the offline bundler and quality checks live
outside the package, in the repository's `tools/` folder (`python tools/<name>.py`), and the
reliability campaign (load, faults, fuzzing) beside its tests (`tests/reliability_campaign.py`);
their results and the benchmarks' are in `benchmarks/results/` (its README lists each file's
command and commit).
"""
