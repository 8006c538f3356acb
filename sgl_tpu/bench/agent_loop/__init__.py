"""Agent-loop benchmark harness (`python -m sgl_tpu.bench.agent_loop`).

    workloads.py  programs of steps (react, tool-json, tree-of-thought, multi-turn-chat,
                  shared-prefix, agent-trace), from text.py's synthetic text, deterministic
                  under a seed; agent_trace.py has agent-trace's parameters and compaction
    runner.py     programs -> concurrent coroutines -> requests, each carrying the program's
                  context so far -> Trace
    client.py     one streamed HTTP request -> RequestRecord (trace.py)
    drivers.py    request bodies and stream parsing per API (native, OpenAI completions/chat);
                  gbnf.py turns the tool-call schema into a llama.cpp grammar
    metrics.py    Trace -> summary; table.py and plot.py show summaries
    oracle.py     Trace -> the prompt tokens an unbounded cache would reuse, against the reused
    targets.py    the --compare spec syntax; launching sgl-tpu or the llama.cpp peer
    __main__.py   the CLI: targets x workloads -> table, JSON, PNG
"""
