"""JSON-producing programs in SGLang's frontend language, with constrained decoding on an sgl-tpu
server: a whole object from a JSON schema (`json_schema=`), and an object assembled field by
field from `regex=`/`dtype=` generations.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/dsl_json_output.py [--url http://127.0.0.1:30000]

The server masks every token that would leave the schema or regex, so each output parses, even
from a 135M model. `run_batch` runs one program per city concurrently; they share the prompt's
instructions, which the frontend pre-caches once.
"""

from __future__ import annotations

import argparse
import json

from _frontend import sgl  # examples/_frontend.py

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "country": {"type": "string", "maxLength": 32},
        "is_capital": {"type": "boolean"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40},
                      "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "is_capital", "landmarks"],
    "additionalProperties": False,
}


@sgl.function
def city_card(s, city: str):
    s += sgl.system("You describe cities as compact JSON objects.")
    s += sgl.user(f"Describe {city}.")
    s += sgl.assistant(sgl.gen("card", json_schema=json.dumps(CITY_SCHEMA), max_tokens=128))


@sgl.function
def city_fields(s, city: str):
    s += 'Facts about Rome, as JSON.\n{\n  "name": "Rome",\n  "founded": 753,\n'
    s += '  "population_millions": 2.8,\n  "on_the_coast": false\n}\n\n'
    s += f"Facts about {city}, as JSON.\n"
    with s.var_scope("record"):
        s += "{\n"
        # The space goes inside the regex: the model writes ' "' as one token, and a prompt
        # ending in a space would leave only unnatural tokens to start the string with.
        s += '  "name":' + sgl.gen(regex=r' "[A-Za-z ]{1,30}"', max_tokens=16) + ",\n"
        s += '  "founded": ' + sgl.gen(regex=r"[0-9]{3,4}", max_tokens=4) + ",\n"
        s += '  "population_millions": ' + sgl.gen(dtype=float, max_tokens=6) + ",\n"
        s += '  "on_the_coast": ' + sgl.gen(regex="(true|false)") + "\n"
        s += "}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    cities = ["Paris", "Tokyo", "Nairobi"]

    for city, st in zip(cities, city_card.run_batch([{"city": c} for c in cities],
                                                    temperature=0), strict=True):
        if st.error() is not None:
            raise SystemExit(f"program failed: {st.error()}")
        print(f"{city}: {json.dumps(json.loads(st['card']))}")

    for city, st in zip(cities, city_fields.run_batch([{"city": c} for c in cities],
                                                      temperature=0), strict=True):
        if st.error() is not None:
            raise SystemExit(f"program failed: {st.error()}")
        print(f"{city} (field by field): {json.dumps(json.loads(st['record']))}")


if __name__ == "__main__":
    main()
