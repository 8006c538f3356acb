"""Parallel branches from one shared prefix (`fork`/`join`) in SGLang's frontend language.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/dsl_fork_join.py [--url http://127.0.0.1:30000]

An agent reviewing a product description forks into one branch per aspect. The branches run
concurrently; each request is the shared description plus a few branch tokens, so the server
computes the description once and every branch reuses it from the radix cache (the trace
prints `cached_tokens` / `prompt_tokens` per branch). `join` gathers the branch outputs back
into the main program, which writes a verdict from them.
"""

from __future__ import annotations

import argparse

from _frontend import sgl  # examples/_frontend.py

PRODUCT = """Product: TrailLite 2 tent.
Weight 1.2 kg, packs to the size of a water bottle. Sleeps two, with one door and one vestibule.
Pitches in three minutes with a single hubbed pole. Fly and floor are 20-denier silnylon with a
3000 mm hydrostatic head; seams are taped. Mesh inner body, so it breathes well in summer but is
cold in early spring. Price: 420 euros, with a two-year warranty. Reviewers praise the weight and
the quick pitch, and complain that two people cannot sit up at the same time.
"""

ASPECTS = ("weight and packing", "weather protection", "comfort for two people", "value for money")


@sgl.function
def review(s, product: str, aspects: tuple[str, ...]):
    s += sgl.system("You are a careful outdoor-gear reviewer. Answer in one sentence.")
    s += sgl.user(product + "\nHow good is this tent?")
    s += sgl.assistant_begin()
    s += "Let me go through it aspect by aspect.\n"
    branches = s.fork(len(aspects))
    for branch, aspect in zip(branches, aspects, strict=True):
        branch += f"On {aspect}, " + sgl.gen("note", max_tokens=40, stop="\n")
    branches.join()
    for aspect, note in zip(aspects, s["note"], strict=True):
        s += f"On {aspect}, {note}\n"
    s += "Verdict:" + sgl.gen("verdict", max_tokens=40, stop="\n")
    s += sgl.assistant_end()
    s.set_var("branch_meta", [b.get_meta_info("note") for b in branches])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))

    st = review.run(product=PRODUCT, aspects=ASPECTS, temperature=0, frequency_penalty=0.6)
    if st.error() is not None:
        raise SystemExit(f"program failed: {st.error()}")
    for aspect, note, meta in zip(ASPECTS, st["note"], st["branch_meta"], strict=True):
        print(f"[{aspect}] {note.strip()}")
        print(f"    cached {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens")
    print("Verdict:", st["verdict"].strip())


if __name__ == "__main__":
    main()
