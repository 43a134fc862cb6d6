"""Loading a config: YAML/JSON files, dotted ``KEY.PATH=VALUE`` overrides, readable errors.

A pydantic `ValidationError`, the DeepSpeed options jaxspeed does not support and the bad
overrides become one one-line `ConfigError` that lists every invalid key path (with a
did-you-mean for misspelt keys), each under what set it: the file, or the override (`--set`).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from jaxspeed.config.deepspeed import (
    DEEPSPEED_RENAMED,
    _rename_deepspeed,
    _translate_deepspeed,
    _warn_dropped,
)
from jaxspeed.config.deepspeed_auto import DeepSpeedAutoWarning, describe_auto, resolve_auto
from jaxspeed.config.key_paths import Problem, _insert, _plain
from jaxspeed.config.cross_field import cross_field_errors
from jaxspeed.config.schema import CROSS_FIELD, Config
from jaxspeed.config.validation_errors import describe_error, key_path
from jaxspeed.errors import ConfigError


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
        problems += [Problem(key_path(e["loc"]).path, describe_error(e)) for e in err.errors()]
        problems += [Problem("", text) for text in _rules_over_valid_sections(tree, err)]
    if problems:
        keys = [text.partition("=")[0].strip() if isinstance(text, str) else "" for text in renamed]
        raise ConfigError(_message(problems, where=where, overrides=list(zip(keys, names))))
    _warn_dropped(dropped, stacklevel=3)
    if autos:
        warnings.warn(describe_auto(config, autos), DeepSpeedAutoWarning, stacklevel=2)
    if file is not None and not {"model", "data"} <= tree.keys():
        warnings.warn(_defaults_notice(file, tree, config), DefaultSectionsWarning, stacklevel=2)
    return config


def _rules_over_valid_sections(tree: Any, err: ValidationError) -> list[str]:
    """The cross-field rules' messages over the sections of `tree` that are valid, when others
    are not (`Config`'s own validator runs only on a whole valid config)."""
    failed = frozenset(str(e["loc"][0]) for e in err.errors() if e["loc"])
    if not failed or not isinstance(tree, Mapping):
        return []
    valid = {key: value for key, value in tree.items() if key not in failed}
    try:
        partial = Config.model_validate(valid, context={CROSS_FIELD: False})
    except ValidationError:  # an error only the whole config shows: already reported
        return []
    return cross_field_errors(partial, skip=failed)


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
        lines = [describe_error({**error, "loc": (at, *error["loc"])}) for error in err.errors()]
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
        lines = [describe_error(error) for error in err.errors()]
        raise ConfigError(f"invalid config with {why}: " + "; ".join(lines)) from None
