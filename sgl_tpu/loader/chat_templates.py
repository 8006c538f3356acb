"""`--chat-template`: a chat template for models that carry none (base models such as Gemma 3
270M) or to replace the model's own, as SGLang's flag does.

    --chat-template gemma          a built-in template (BUILTIN_TEMPLATES)
    --chat-template path.jinja     a Jinja file, rendered like the model's own template

Without one, a model with no template of its own serves completions and the native API only;
chat requests get a 400 naming this flag.
"""

from __future__ import annotations

from pathlib import Path

from sgl_tpu.loader.tokenizer import Tokenizer

# Gemma's turn format: system text opens the first user turn; assistant turns are "model".
_GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ (system if loop.first else '') + (m['content'] or '') | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILTIN_TEMPLATES = {"gemma": _GEMMA, "chatml": _CHATML}


def check_chat_template(value: str) -> None:
    """ValueError unless `value` names a built-in template or an existing file."""
    if value not in BUILTIN_TEMPLATES and not Path(value).is_file():
        raise ValueError(f"chat_template must be one of {', '.join(BUILTIN_TEMPLATES)} or a "
                         f"Jinja file, got {value!r} (no such file)")


def chat_template_source(value: str) -> str:
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    check_chat_template(value)
    return Path(value).read_text(encoding="utf-8")


def with_chat_template(tokenizer: Tokenizer, value: str | None) -> Tokenizer:
    """`tokenizer` with the `--chat-template` override (unchanged when None)."""
    if value is None:
        return tokenizer
    return Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id,
                     eos_token_ids=tokenizer.eos_token_ids,
                     chat_template=chat_template_source(value))
