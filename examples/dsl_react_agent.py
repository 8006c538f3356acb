"""A ReAct-style tool loop in SGLang's frontend language, against a running sgl-tpu server.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/dsl_react_agent.py [--url http://127.0.0.1:30000] [--question "..."]

Each step the model writes a thought (`gen` up to the newline), picks its action with `select`
(scored by prompt log-probs, so it is always one of the tools), and writes the argument with
`gen(stop="]")`. The tool runs here, in Python, and its observation is appended to the program
state, so every next request extends the previous one and the server's radix cache serves the
whole trajectory so far (see `cached_tokens` in the trace).
"""

from __future__ import annotations

import argparse
import ast
import operator

from _frontend import sgl  # examples/_frontend.py

FACTS = {
    "eiffel tower height": "The Eiffel Tower is 330 metres tall.",
    "statue of liberty height": "The Statue of Liberty is 93 metres tall.",
    "days in a leap year": "A leap year has 366 days.",
    "speed of sound": "Sound travels at about 343 metres per second in air.",
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Arithmetic only: numbers, + - * / and parentheses."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return f"{value:g}"


def lookup(query: str) -> str:
    q = query.strip().lower()
    for key, fact in FACTS.items():
        if key in q or q in key:
            return fact
    return "No entry found. Known topics: " + ", ".join(FACTS) + "."


TOOLS = {"calculate": calculate, "lookup": lookup}

INSTRUCTIONS = """Answer the question using tools. Each step has a Thought, then an Action.
Actions: calculate [arithmetic expression], lookup [topic], finish [final answer].

Question: What is 12 times 7, plus 5?
Thought 1: I need to compute 12 * 7 + 5.
Action 1: calculate [12 * 7 + 5]
Observation 1: 89
Thought 2: I have the result.
Action 2: finish [89]

Question: How tall is the Eiffel Tower?
Thought 1: I should look it up.
Action 1: lookup [eiffel tower height]
Observation 1: The Eiffel Tower is 330 metres tall.
Thought 2: I know the answer now.
Action 2: finish [330 metres]

"""


@sgl.function
def react_agent(s, question: str, max_steps: int = 4):
    s += INSTRUCTIONS + "Question: " + question + "\n"
    for step in range(1, max_steps + 1):
        s += f"Thought {step}:" + sgl.gen(f"thought_{step}", max_tokens=32, stop="\n") + "\n"
        s += f"Action {step}:" + sgl.select(f"action_{step}",
                                            [" calculate", " lookup", " finish"])
        s += " [" + sgl.gen(f"arg_{step}", max_tokens=24, stop=["]", "\n"]) + "]\n"
        action, arg = s[f"action_{step}"].strip(), s[f"arg_{step}"].strip()
        if action == "finish":
            s.set_var("answer", arg)
            return
        s += f"Observation {step}: {TOOLS[action](arg)}\n"
    s.set_var("answer", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--question", action="append",
                   help="ask this (repeatable); default: two built-in questions")
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    questions = args.question or ["What is 17 times 23?",
                                  "How tall is the Statue of Liberty?"]
    # One program per question, all at once: the shared instructions are computed once.
    states = react_agent.run_batch([{"question": q} for q in questions], temperature=0)
    for st in states:
        if st.error() is not None:
            raise SystemExit(f"program failed: {st.error()}")
        print("=" * 72)
        print(st.text()[len(INSTRUCTIONS):].rstrip())
        cached = [st.get_meta_info(f"arg_{k}")["cached_tokens"]
                  for k in range(1, 5) if f"arg_{k}" in st]
        print(f"-> answer: {st['answer']!r}   (cached prompt tokens per step: {cached})")


if __name__ == "__main__":
    main()
