"""Pydantic's validation errors of a `Config`, in the config's own words: each error's key path
(`optimizer.params.lr`, tagged-union tags dropped) and one line that names it, with a
did-you-mean for a misspelt key."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from jaxspeed.config.schema import Config
from jaxspeed.errors import did_you_mean


def describe_error(error: Mapping[str, Any]) -> str:
    """One line for one pydantic error: `key.path: message (got VALUE)`."""
    where = key_path(error["loc"])
    path, kind, value = where.path, error["type"], error.get("input")
    if kind == "union_tag_invalid":
        key, tag = error["ctx"]["discriminator"].strip("'"), error["ctx"]["tag"]
        accepted = [name.strip(" '") for name in error["ctx"]["expected_tags"].split(",")]
        return (
            f"{path}.{key}: unknown {path} {key} {tag!r}; accepted: {', '.join(accepted)}"
            + did_you_mean(tag, accepted)
        )
    if kind == "missing":
        needed_by = f" for {where.tag}" if where.tag and where.section is not None else ""
        return f"{path} is required{needed_by}"
    shown = kind == "value_error" and (isinstance(value, Mapping) or repr(value) in error["msg"])
    got = "" if shown else f" (got {_short_repr(value)})"
    if kind == "extra_forbidden":
        return f"{path}: unknown key{got}{_unknown_key_hint(str(error['loc'][-1]), where.section)}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}{got}" if path else f"{message}{got}"


def _unknown_key_hint(key: str, section: type[BaseModel] | None) -> str:
    """Where `key` belongs, else the closest accepted key of `section`, else all of them."""
    if section is not None and key in section.moved_keys:
        return f"; use {section.moved_keys[key]} instead"
    fields = {} if section is None else section.model_fields
    accepted = [field.alias or name for name, field in fields.items()]
    close = difflib.get_close_matches(key, accepted, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; accepted keys: {', '.join(accepted) or '(none)'}"


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _KeyPath(NamedTuple):
    """Where a pydantic error is, in the config's own keys."""

    #: the dotted key path (`optimizer.params.lr`), without the tags of tagged unions
    path: str
    #: the section that holds the path's last key (None when that is not a section)
    section: type[BaseModel] | None
    #: the tagged-union member the path runs through (`scheduler.type WarmupCosine`), or ""
    tag: str


def key_path(loc: Sequence[Any]) -> _KeyPath:
    """Reads a pydantic error location as a key path into `Config`.

    Pydantic puts the tag of a tagged union after its key (`optimizer.AdamW.params.lr`); the
    user never writes it, so it is dropped (`optimizer.params.lr`), and it picks the section
    that the rest of the path runs through.
    """
    keys: list[Any] = []
    tag = ""
    section: type[BaseModel] | None = None
    model: type[BaseModel] | None = Config
    parts = iter(loc)
    for part in parts:
        keys.append(part)
        section, model = model, None
        field = None if section is None else _fields(section).get(part)
        if field is None:
            continue
        members = _sections_in(field.annotation)
        if isinstance(field.discriminator, str):
            chosen = next(parts, None)
            members = [m for m in members if m.model_fields[field.discriminator].default == chosen]
            tag = f"{_dotted(keys)}.{field.discriminator} {chosen}" if members else tag
        model = members[0] if members else None
    return _KeyPath(_dotted(keys), section, tag)


def _dotted(keys: Sequence[Any]) -> str:
    return ".".join(f"[{key}]" if isinstance(key, int) else str(key) for key in keys).replace(
        ".[", "["
    )


def _fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A section's fields by key: aliases (the config's own names) first, then field names."""
    fields = {(field.alias or name): field for name, field in model.model_fields.items()}
    return fields | {name: field for name, field in model.model_fields.items()}


def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The section models in a field's type (several in a union), in order."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _sections_in(arg)]
