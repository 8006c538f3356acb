"""Synthetic, plausible English for the agent workloads: no downloads, deterministic under a seed.

Every function takes a `random.Random` and draws only from it, so a workload built from one seed
is the same text on every machine. Lengths are asked for in approximate tokens
(`CHARS_PER_TOKEN` characters each, measured on this text with the default model); the harness
reports the real counts with the model's tokenizer.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 3.2  # SmolLM2 splits every digit: 3.2 keeps sizes near the asked ones

NOUNS = (
    "city", "river", "company", "report", "dataset", "engine", "library", "museum", "invoice",
    "satellite", "protein", "contract", "forecast", "bridge", "network", "harvest", "budget",
    "vaccine", "glacier", "festival", "airport", "algorithm", "manuscript", "reactor", "market",
    "treaty", "telescope", "pipeline", "election", "orchard", "warehouse", "battery", "canal",
    "archive", "tournament", "mineral", "highway", "recipe", "painting", "volcano",
)
ADJECTIVES = (
    "recent", "largest", "northern", "official", "annual", "quarterly", "historic", "regional",
    "public", "estimated", "median", "primary", "modern", "coastal", "independent", "average",
    "revised", "preliminary", "national", "digital", "seasonal", "industrial", "ancient",
)
VERBS = (
    "reported", "increased", "measured", "published", "approved", "recorded", "announced",
    "estimated", "confirmed", "reduced", "expanded", "delayed", "compared", "released",
)
PLACES = (
    "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Perth", "Montreal", "Valparaiso",
    "Bergen", "Tbilisi", "Hanoi", "Accra", "Cusco", "Gdansk", "Adelaide", "Marrakesh",
    "Reykjavik", "Seville", "Dakar", "Porto", "Kyoto", "Bogota", "Tromso", "Zanzibar",
)
PEOPLE = (
    "Ada Lovelace", "Marie Curie", "Alan Turing", "Grace Hopper", "Nikola Tesla",
    "Rosalind Franklin", "Srinivasa Ramanujan", "Hedy Lamarr", "Katherine Johnson",
    "Emmy Noether", "Claude Shannon", "Barbara McClintock", "John von Neumann",
)
CONNECTIVES = ("However,", "Meanwhile,", "In addition,", "As a result,", "By contrast,",
               "According to the source,", "In practice,", "Notably,")
UNITS = ("percent", "kilometres", "tonnes", "million dollars", "residents", "megawatts",
         "hectares", "visitors", "units", "degrees")


def number(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return str(rng.randrange(2, 99))
    if kind == 1:
        return f"{rng.randrange(100, 9999):,}"
    return f"{rng.randrange(1, 99)}.{rng.randrange(10)}"


def year(rng: random.Random) -> str:
    return str(rng.randrange(1890, 2025))


def sentence(rng: random.Random) -> str:
    """One factual-sounding sentence."""
    form = rng.randrange(5)
    noun, adj, place = rng.choice(NOUNS), rng.choice(ADJECTIVES), rng.choice(PLACES)
    if form == 0:
        text = (f"The {adj} {noun} of {place} {rng.choice(VERBS)} {number(rng)} "
                f"{rng.choice(UNITS)} in {year(rng)}.")
    elif form == 1:
        text = (f"{rng.choice(PEOPLE)} studied the {noun} near {place} and "
                f"{rng.choice(VERBS)} a {adj} result.")
    elif form == 2:
        text = (f"In {year(rng)}, the {noun} in {place} was {rng.choice(VERBS)} by "
                f"{number(rng)} {rng.choice(UNITS)} compared with the {adj} baseline.")
    elif form == 3:
        text = (f"{rng.choice(CONNECTIVES)} the {adj} {noun} remains the main source for "
                f"questions about {place}.")
    else:
        text = (f"Records show that the {noun} of {place} is {number(rng)} "
                f"{rng.choice(UNITS)}, according to the {adj} {rng.choice(NOUNS)}.")
    return text


def paragraph(rng: random.Random, approx_tokens: int) -> str:
    """Sentences until about `approx_tokens` tokens."""
    target_chars = approx_tokens * CHARS_PER_TOKEN
    parts: list[str] = []
    size = 0
    while size < target_chars:
        s = sentence(rng)
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts)


def question(rng: random.Random) -> str:
    noun, place = rng.choice(NOUNS), rng.choice(PLACES)
    forms = (
        f"What was the {rng.choice(ADJECTIVES)} {noun} of {place} in {year(rng)}, and how does "
        f"it compare with {rng.choice(PLACES)}?",
        f"Who first {rng.choice(VERBS)} the {noun} in {place}, and what changed afterwards?",
        f"Find the {rng.choice(ADJECTIVES)} figure for the {noun} of {place} and convert it "
        f"to {rng.choice(UNITS)}.",
        f"Summarise what is known about the {noun} near {place} and list two open questions.",
    )
    return rng.choice(forms)


def search_query(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(PLACES)} {year(rng)}"


def observation(rng: random.Random, approx_tokens: int) -> str:
    """A tool result: numbered search snippets about `approx_tokens` tokens long."""
    target_chars = approx_tokens * CHARS_PER_TOKEN
    lines: list[str] = []
    size = 0
    while size < target_chars:
        line = f"[{len(lines) + 1}] {sentence(rng)}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)
