"""option.chat_template: the template itself, or the file that holds it.

The rule (vLLM's for `--chat-template`): a value with a `{`, a `}` or a line break is the template's
text, since any Jinja template that renders a message has `{{` or `{%`; any other value names a file.
A relative file name is looked up in the model folder first (as option.entryPoint is), then in the
working directory. A file that cannot be found or read is a start-up error naming the places tried;
the configuration then holds the file's absolute path, so every worker reads the same file.
"""

from __future__ import annotations

from pathlib import Path

_TEMPLATE_CHARS = "{}\n"


def is_inline(value: str) -> bool:
    """Whether `value` is a template's text rather than a file name."""
    return any(char in value for char in _TEMPLATE_CHARS)


def resolve(value: str, model_dir: str | None) -> str:
    """`value` as the configuration keeps it: inline text unchanged, a file name as the absolute path
    of a readable file (ValueError saying where it looked otherwise)."""
    if is_inline(value):
        return value
    name = Path(value).expanduser()
    places = [name] if name.is_absolute() else [*([Path(model_dir) / name] if model_dir else []), Path.cwd() / name]
    found = next((place for place in places if place.is_file()), None)
    if found is None:
        where = " or ".join(str(place) for place in places)
        raise ValueError(f"names no file ({where}); a template given inline must contain `{{{{` or `{{%`")
    text_of(str(found))  # unreadable or not UTF-8: fail now, not at load
    return str(found.resolve())


def text_of(value: str) -> str:
    """The template's text: `value` itself when inline, else the named file's contents."""
    if is_inline(value):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the template file {value}: {exc}") from None
