"""Field types and the base class every config section shares.

Ints and bools are strict: `true` is not 1 and "3" is not 3 (YAML and JSON already give real
numbers and booleans); floats accept ints. Every section has ``extra="forbid"``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


def whole_number(value: Any) -> Any:
    """`1e9` as DeepSpeed configs write counts (a float in JSON) is the int 1_000_000_000."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _mesh_size(value: int) -> int:
    if value < 1 and value != -1:
        raise ValueError("mesh axis size must be >= 1, or -1 to fill from the device count")
    return value


Int = Annotated[int, Field(strict=True)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
MeshSize = Annotated[int, Field(strict=True), AfterValidator(_mesh_size)]
Bool = Annotated[bool, Field(strict=True)]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; fields load by name or alias."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)
    #: keys that belong elsewhere → where: the unknown-key error says so instead of guessing
    moved_keys: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
