"""The one CLI parser, derived from the `ServerArgs` fields (`sgl_tpu/settings.py`): flags named
as SGLang names them, with each field's help text, default and choices; its inverse
(`to_argv`), with which the `--dp-size` launcher starts each replica; and the flag table of
docs/serving.md (`python -m sgl_tpu.cli --markdown docs/serving.md` rewrites it)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from sgl_tpu.choices import check_chat_template_choice, registry_choices
from sgl_tpu.config import ServerArgs

ROUTER_FLAG_PREFIX = "--router-"
# Accepted and ignored, as SGLang spells them: flag -> help.
_COMPAT_FLAGS = {"--mem-fraction-static": "accepted for SGLang compatibility; use "
                                          "--max-total-tokens"}
TABLE_START = "<!-- flag table: python -m sgl_tpu.cli --markdown docs/serving.md -->"
TABLE_END = "<!-- end of flag table -->"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_tpu.launch_server",
                                description="sgl-tpu: LLM server with a radix prefix cache")
    registry = registry_choices()
    for f in dataclasses.fields(ServerArgs):
        if not f.metadata["flag"]:
            continue
        kw = {"help": f.metadata["help"], "default": f.default}
        if f.type == "bool":
            p.add_argument(_flag(f.name), action="store_true", **kw)
        elif f.type.startswith("tuple["):
            p.add_argument(_flag(f.name), nargs="+", **kw)
        else:
            choices = registry.get(f.name) or getattr(f.metadata["check"], "choices", None)
            if choices:
                kw["choices"] = choices
            p.add_argument(_flag(f.name), type=_scalar_type(f.type), **kw)
    for flag, help_text in _COMPAT_FLAGS.items():
        p.add_argument(flag, type=float, default=None, help=help_text)
    return p


def _scalar_type(annotation: str) -> type:
    """`int | None` -> int: the type the flag's value is parsed as."""
    for typ in (int, float):
        if typ.__name__ in annotation.split(" | "):
            return typ
    return str


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    known, unknown = parser.parse_known_args(argv)
    ns = vars(known)
    for flag in _COMPAT_FLAGS:
        ns.pop(flag[2:].replace("-", "_"))
    for f in dataclasses.fields(ServerArgs):  # nargs="+" gives lists
        if f.metadata["flag"] and f.type.startswith("tuple["):
            ns[f.name] = tuple(ns[f.name])
    ns["router_args"] = _router_args(parser, unknown)
    try:
        args = ServerArgs(**ns)
        check_chat_template_choice(args)
        return args
    except ValueError as e:
        parser.error(str(e))
        raise


def _router_args(parser: argparse.ArgumentParser, unknown: list[str]) -> tuple[str, ...]:
    """`--router-NAME [VALUE...]` -> `--NAME [VALUE...]` for the sglang-router; any other
    unknown flag is an error, as with a plain parse."""
    out: list[str] = []
    for token in unknown:
        if token.startswith(ROUTER_FLAG_PREFIX):
            out.append("--" + token[len(ROUTER_FLAG_PREFIX):])
        elif token.startswith("-") or not out:
            parser.error(f"unrecognized arguments: {token}")
        else:
            out.append(token)  # a value of the router flag before it
    return tuple(out)


def to_argv(args: ServerArgs) -> list[str]:
    """The flags that `parse_args` turns back into `args` (fields at their default omitted)."""
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if not f.metadata["flag"] or value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name))
        elif isinstance(value, tuple):
            argv += [_flag(f.name), *value]
        else:
            argv += [_flag(f.name), str(value)]
    for token in args.router_args:  # back to their --router-* spelling
        argv.append(ROUTER_FLAG_PREFIX + token[2:] if token.startswith("--") else token)
    return argv


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def markdown_table() -> str:
    """The flag table of docs/serving.md: one row per flag of `build_parser`, in its order."""
    see = {_flag(f.name): f.metadata["see"] for f in dataclasses.fields(ServerArgs)}
    rows = ["| flag | default | what it does | more |", "|---|---|---|---|"]
    for action in build_parser()._actions:
        flag = action.option_strings[-1]
        if flag == "--help":
            continue
        default = action.default
        shown = ("off" if default is False else "-" if default in (None, ())
                 else f"`{default}`")
        what = action.help
        if action.choices:
            what = "{" + ", ".join(action.choices) + "}: " + what
        more = ", ".join(_link(target) for target in see.get(flag, ()))
        rows.append(f"| `{flag}` | {shown} | {what} | {more} |")
    return "\n".join(rows) + "\n"


def _link(target: str) -> str:
    """"kv-cache-tiers.md#durability" -> [kv-cache-tiers](...); "#a-b---flag" -> [a b](...)."""
    page, _, anchor = target.partition("#")
    text = page.removesuffix(".md") if page else anchor.split("---")[0].replace("-", " ")
    return f"[{text}]({target})"


def write_table(page: Path) -> None:
    """Replace the text between TABLE_START and TABLE_END of `page` with `markdown_table()`."""
    text = page.read_text(encoding="utf-8")
    head, start, rest = text.partition(TABLE_START + "\n")
    _, end, tail = rest.partition(TABLE_END)
    if not start or not end:
        raise SystemExit(f"{page}: no {TABLE_START!r} ... {TABLE_END!r} block")
    page.write_text(head + start + markdown_table() + end + tail, encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--markdown"] or len(sys.argv) > 3:
        raise SystemExit("usage: python -m sgl_tpu.cli --markdown [PAGE]  (print the flag "
                         "table, or rewrite it in PAGE)")
    if len(sys.argv) == 3:
        write_table(Path(sys.argv[2]))
    else:
        sys.stdout.write(markdown_table())
