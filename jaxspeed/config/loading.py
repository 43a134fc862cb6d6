"""Loading a config: YAML/JSON files, dotted ``KEY.PATH=VALUE`` overrides, readable errors.

A pydantic `ValidationError` becomes one `ConfigError` that lists every invalid key path, with a
did-you-mean for misspelt keys.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jaxspeed.config.deepspeed import DEEPSPEED_RENAMED, _translate_deepspeed, _warn_dropped
from jaxspeed.config.key_paths import _insert, _plain
from jaxspeed.config.schema import Config
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


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str] | None) -> dict[str, Any]:
    """Applies `KEY.PATH=VALUE` overrides, VALUE read as YAML.

    `3`, `true`, `[0.9, 0.95]`, `null` and `3e-4` (a float, as in YAML 1.2) all work; a value
    that is not YAML stays a string. Intermediate mappings are created as needed; validation
    happens later.

    Args:
      raw: config dict (not modified).
      overrides: strings such as `"zero_optimization.stage=2"`.

    Returns:
      a new dict with the overrides applied in order.
    """
    tree = _plain(raw)
    for override in _override_list(overrides):
        if not isinstance(override, str) or "=" not in override:
            raise ConfigError(f"override {override!r} must look like KEY.PATH=VALUE")
        key, text = override.split("=", 1)
        keys = key.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override {override!r}: the key path {key!r} has an empty part")
        try:
            value = _parse_yaml(text)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {override!r}: cannot parse the value as YAML: {err}"
            ) from None
        _insert(tree, keys, value, what=f"override {override!r}")
    return tree


def _override_list(overrides: Sequence[str] | None) -> Sequence[str]:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of KEY.PATH=VALUE strings, got {overrides!r}")
    return overrides or ()


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] | None = None,
) -> Config:
    """Loads and validates a config from a YAML/JSON file, a mapping, or defaults.

    DeepSpeed keys are translated (`from_deepspeed`) before and after the overrides, and an
    override may use either name (`train_micro_batch_size_per_gpu=4` replaces the file's
    `train_micro_batch_size_per_device`).

    Args:
      source: path to a `.yaml`/`.yml`/`.json` file, a mapping, a `Config`, or None (defaults).
      overrides: `KEY.PATH=VALUE` strings, see `apply_overrides`.

    Raises:
      ConfigError: one message naming the file and every invalid key.
    """
    where = ""
    if source is None:
        raw: Any = {}
    elif isinstance(source, Config):
        raw = source.model_dump(by_alias=True)
    elif isinstance(source, Mapping):
        raw = source
    elif isinstance(source, (str, os.PathLike)):
        raw, where = _read_file(Path(source)), f" in {os.fspath(source)}"
    else:
        raise ConfigError(
            f"config source must be a file path, a mapping or None, got {type(source).__name__}"
        )
    try:
        raw, dropped = _translate_deepspeed(raw)
    except ConfigError as err:
        if not where:
            raise
        raise ConfigError(f"invalid config{where}:\n{err}") from None
    if overrides:
        renamed = [_renamed_override(text) for text in _override_list(overrides)]
        raw, dropped_too = _translate_deepspeed(apply_overrides(raw, renamed))
        dropped = sorted({*dropped, *dropped_too})
    _warn_dropped(dropped, stacklevel=3)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        lines = [_describe(error) for error in err.errors()]
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(lines)) from None


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
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot parse config file {path}: {err}") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys to values, got {type(raw).__name__}"
        )
    return dict(raw)


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
    loc = error["loc"]
    path = ".".join(f"[{part}]" if isinstance(part, int) else str(part) for part in loc)
    path = path.replace(".[", "[")
    value = error.get("input")
    shown = error["type"] == "value_error" and (
        isinstance(value, Mapping) or repr(value) in error["msg"]
    )
    got = "" if shown else f" (got {_short_repr(value)})"
    if error["type"] == "extra_forbidden":
        accepted = _keys_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), accepted, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        else:
            hint = f"; accepted keys: {', '.join(accepted)}"
        return f"{path}: unknown key{got}{hint}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}{got}" if path else f"{message}{got}"


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keys_at(loc: Sequence[Any]) -> list[str]:
    """Accepted key names of the config section at `loc` (empty if it is not a section)."""
    model: Any = Config
    for part in loc:
        fields = {(field.alias or name): field for name, field in model.model_fields.items()}
        fields |= {name: field for name, field in model.model_fields.items()}
        if part not in fields:
            return []
        model = _section_type(fields[part].annotation)
        if model is None:
            return []
    return [field.alias or name for name, field in model.model_fields.items()]


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None
