"""Loading a config: YAML/JSON files, dotted ``KEY.PATH=VALUE`` overrides, readable errors.

A pydantic `ValidationError`, the DeepSpeed options jaxspeed does not support and the bad
overrides become one one-line `ConfigError` that lists every invalid key path (with a
did-you-mean for misspelt keys), each under what set it: the file, or the override (`--set`).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from jaxspeed.config.deepspeed import (
    DEEPSPEED_RENAMED,
    _rename_deepspeed,
    _translate_deepspeed,
    _warn_dropped,
)
from jaxspeed.config.deepspeed_auto import DeepSpeedAutoWarning, describe_auto, resolve_auto
from jaxspeed.config.key_paths import Problem, _insert, _plain
from jaxspeed.config.schema import Config
from jaxspeed.errors import ConfigError, did_you_mean


class _YamlLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads `3e-4` as a float (YAML 1.2), not as a string."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)


def apply_overrides(
    raw: Mapping[str, Any], overrides: Sequence[str] | None, *, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Applies `KEY.PATH=VALUE` overrides, VALUE read as YAML.

    `3`, `true`, `[0.9, 0.95]`, `null` and `3e-4` (a float, as in YAML 1.2) all work; a value
    that is not YAML stays a string. Intermediate mappings are created as needed; validation
    happens later.

    Args:
      raw: config dict (not modified).
      overrides: strings such as `"zero_optimization.stage=2"`.
      names: how an error names each override (the CLI: `"--set KEY=VALUE"`); default
        `"override KEY=VALUE"`.

    Returns:
      a new dict with the overrides applied in order.
    """
    tree = _plain(raw)
    overrides = _override_list(overrides)
    names = list(names or [f"override {text!r}" for text in overrides])
    for override, name in zip(overrides, names, strict=True):
        if not isinstance(override, str) or "=" not in override:
            raise ConfigError(f"invalid {name}: it must look like KEY.PATH=VALUE")
        key, text = override.split("=", 1)
        keys = key.strip().split(".")
        if not all(keys):
            raise ConfigError(f"invalid {name}: the key path {key!r} has an empty part")
        try:
            value = _parse_yaml(text)
        except yaml.YAMLError as err:
            reason = " ".join(str(err).split())
            raise ConfigError(f"invalid {name}: cannot parse the value as YAML: {reason}") from None
        _insert(tree, keys, value, what=f"invalid {name}")
    return tree


def _override_list(overrides: Sequence[str] | None) -> Sequence[str]:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of KEY.PATH=VALUE strings, got {overrides!r}")
    return list(overrides or ())


class DefaultSectionsWarning(UserWarning):
    """A config file has no `model:` or `data:` section: the run uses the defaults."""


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] | None = None,
    *,
    override_names: Sequence[str] | None = None,
) -> Config:
    """Loads and validates a config from a YAML/JSON file, a mapping, or defaults.

    DeepSpeed keys are translated (`from_deepspeed`) before and after the overrides, and an
    override may use either name (`train_micro_batch_size_per_gpu=4` replaces the file's
    `train_micro_batch_size_per_device`). DeepSpeed's `"auto"` values are filled in
    (`jaxspeed.config.deepspeed_auto`), with one warning saying what each became.

    Args:
      source: path to a `.yaml`/`.yml`/`.json` file, a mapping, a `Config`, or None (defaults).
      overrides: `KEY.PATH=VALUE` strings, see `apply_overrides`.
      override_names: how errors name each override (the CLI: `"--set KEY=VALUE"`,
        `"--device-memory 12GiB"`); default `"override KEY=VALUE"`.

    Raises:
      ConfigError: one line naming every invalid key, each under the file or the override
        that set it.
    Warns:
      DeepSpeedOptionWarning: DeepSpeed options that have no effect were dropped.
      DeepSpeedAutoWarning: DeepSpeed `"auto"` values were filled in.
      DefaultSectionsWarning: a config file has no `model:` or `data:` section.
    """
    where, file = "", None
    if source is None:
        raw: Any = {}
    elif isinstance(source, Config):
        raw = source.model_dump(by_alias=True)
    elif isinstance(source, Mapping):
        raw = source
    elif isinstance(source, (str, os.PathLike)):
        file = Path(source)
        raw, where = _read_file(file), f" in {os.fspath(source)}"
    else:
        raise ConfigError(
            f"config source must be a file path, a mapping or None, got {type(source).__name__}"
        )
    overrides = _override_list(overrides)
    names = list(override_names or [f"override {text!r}" for text in overrides])
    raw, problems = _rename_deepspeed(raw)  # so that an override may use either name
    renamed = [_renamed_override(text) for text in overrides]
    tree, dropped, more = _translate_deepspeed(apply_overrides(raw, renamed, names=names))
    problems += [problem for problem in more if problem not in problems]
    autos = resolve_auto(tree)
    try:
        config = Config.model_validate(tree)
    except ValidationError as err:
        problems += [Problem(_key_path(e["loc"]).path, _describe(e)) for e in err.errors()]
    if problems:
        keys = [text.partition("=")[0].strip() if isinstance(text, str) else "" for text in renamed]
        raise ConfigError(_message(problems, where=where, overrides=list(zip(keys, names))))
    _warn_dropped(dropped, stacklevel=3)
    if autos:
        warnings.warn(describe_auto(config, autos), DeepSpeedAutoWarning, stacklevel=2)
    if file is not None and not {"model", "data"} <= tree.keys():
        warnings.warn(_defaults_notice(file, tree, config), DefaultSectionsWarning, stacklevel=2)
    return config


def _message(problems: Sequence[Problem], *, where: str, overrides: Sequence[tuple[str, str]]) -> str:
    """One line: the problems grouped under what caused them (an override, else the config)."""
    by_cause: dict[str, list[str]] = {}
    for problem in problems:
        cause = next(
            (name for key, name in reversed(overrides) if _caused_by(problem, key)),
            f"config{where}",
        )
        by_cause.setdefault(cause, []).append(problem.text)
    return "; ".join(f"invalid {cause}: {'; '.join(texts)}" for cause, texts in by_cause.items())


def _caused_by(problem: Problem, key: str) -> bool:
    """Whether the override of `key` may have caused `problem`: the same key, a key inside or
    around it, or (for a problem of the whole config) a message that names it."""
    path = problem.path
    if not key:
        return False
    if not path:
        return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", problem.text) is not None
    return path == key or key.startswith(path + ".") or path.startswith(key + ".")


def _defaults_notice(file: Path, tree: Mapping[str, Any], config: Config) -> str:
    """One line: which of `model:` and `data:` the file lacks, and what the run uses instead."""
    missing = [section for section in ("model", "data") if section not in tree]
    uses = []
    if "model" in missing:
        m = config.model
        if config.checkpoint.load_from is not None:
            uses.append(f"the model of checkpoint.load_from={config.checkpoint.load_from}")
        else:
            uses.append(
                f"the default model ({m.type}: d_model={m.d_model}, n_layers={m.n_layers}, "
                f"n_heads={m.n_heads}, vocab_size={m.vocab_size})"
            )
    if "data" in missing:
        d = config.data
        data = ("the Python standard library's source files as bytes" if d.source == "stdlib"
                else f"source {d.source}")
        uses.append(f"on the default data ({data})")
    sections = " or ".join(f"{section}:" for section in missing)
    add = "/".join(f"{section}:" for section in missing)
    return (
        f"{file.name} has no {sections} section: training {' '.join(uses)}; add {add} "
        f"section{'s' if len(missing) > 1 else ''} or --set {missing[0]}.KEY=VALUE"
    )


def _read_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"config file {path} must end in .yaml, .yml or .json")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    try:
        raw = json.loads(text) if suffix == ".json" else _parse_yaml(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"cannot parse config file {path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse config file {path}{_yaml_problem(err)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys to values, got {type(raw).__name__}"
        )
    return dict(raw)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error as one line: `" at line L, column C: PROBLEM (CONTEXT at line L', column C')"`.

    PyYAML's own message spans several lines, quoting the text with a caret under each mark;
    its marks count from 0, an editor's from 1.
    """
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return ": " + " ".join(str(err).split())
    problem = " ".join(str(getattr(err, "problem", None) or "syntax error").split())
    line = f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and context_mark is not None and (context_mark.line, context_mark.column) != (mark.line, mark.column):
        line += f" ({' '.join(context.split())} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return line


def _renamed_override(text: str) -> str:
    """Rewrites an override's DeepSpeed key (or a key under it) to the jaxspeed key."""
    if not isinstance(text, str):
        return text
    key, sep, value = text.partition("=")
    for ds_key, js_key in DEEPSPEED_RENAMED.items():
        if key.strip() == ds_key or key.strip().startswith(ds_key + "."):
            return js_key + key.strip()[len(ds_key) :] + sep + value
    return text


def _describe(error: Mapping[str, Any]) -> str:
    """One line for one pydantic error: `key.path: message (got VALUE)`."""
    where = _key_path(error["loc"])
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


def _key_path(loc: Sequence[Any]) -> _KeyPath:
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


def validate_section(section: Any, raw: Any, *, at: str) -> Any:
    """Validates one section on its own (`build_gpt` validates `model:`, `jaxspeed.optim` an
    `optimizer:` or `scheduler:` so), with `load_config`'s messages and key paths under `at`.

    Args:
      section: the section's type: a model such as `ModelConfig`, or a union such as
        `OptimizerConfig`.
      raw: a mapping, or an object whose attributes are the section's keys.
      at: the section's key in `Config`, e.g. "model".

    Raises:
      ConfigError: one message with every invalid key.
    """
    try:
        return TypeAdapter(section).validate_python(
            raw, from_attributes=not isinstance(raw, Mapping))
    except ValidationError as err:
        lines = [_describe({**error, "loc": (at, *error["loc"])}) for error in err.errors()]
        raise ConfigError(f"invalid {at}: " + "; ".join(lines)) from None


def replace_sections(config: Config, *, why: str, **sections: Any) -> Config:
    """`config` with whole sections replaced, validated again as one config.

    Each section keeps what it says was given (`model_fields_set`), and so does `config`.

    Args:
      config: a validated config.
      why: what the sections come from, for the error (e.g. "the model of checkpoint.load_from=X").
      **sections: section name → its new validated section (e.g. `model=ModelConfig(...)`).

    Raises:
      ConfigError: the new sections do not go with the rest of `config`, in one line.
    """
    given = {name: getattr(config, name) for name in config.model_fields_set}
    try:
        return Config.model_validate({**given, **sections})
    except ValidationError as err:
        lines = [_describe(error) for error in err.errors()]
        raise ConfigError(f"invalid config with {why}: " + "; ".join(lines)) from None
