"""The public surface: the README's "Public API" table is `jaxspeed.__all__`, typed, and old
names keep working. (That no library call changes the host allocator: test_host_allocator.)"""

import re
import typing
from pathlib import Path

import pytest

import jaxspeed as js

ROOT = Path(__file__).resolve().parents[1]


def _readme_api_names() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)`", section, re.MULTILINE)


def test_the_readme_lists_exactly_the_public_names():
    names = _readme_api_names()
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert set(names) - set(js.__all__) == set(), "in the README, not in jaxspeed.__all__"
    assert set(js.__all__) - set(names) == set(), "in jaxspeed.__all__, not in the README"
    assert len(js.__all__) == len(set(js.__all__))


def test_every_public_name_exists():
    missing = [name for name in js.__all__ if not hasattr(js, name)]
    assert not missing


def test_reports_and_the_run_loop_are_typed():
    assert typing.get_type_hints(js.Engine.memory_report)["return"] is js.MemoryReport
    assert typing.get_type_hints(js.Engine.profile)["return"] is js.ProfileReport
    assert typing.get_type_hints(js.train_model)["return"] is js.TrainRecord
    assert {"per_device_bytes", "sources", "device_model"} <= js.MemoryReport.__annotations__.keys()
    assert {"flops", "collective_bytes"} <= js.ProfileReport.__annotations__.keys()
    # `jaxspeed.train` stays the package; its loop's `train` is `train_model` at the top
    assert js.train.train is js.train_model and js.train.__name__ == "jaxspeed.train"


def test_old_export_module_still_works_with_a_warning(monkeypatch):
    monkeypatch.delitem(vars(js), "export", raising=False)  # `import jaxspeed.export` binds it
    with pytest.warns(DeprecationWarning, match="use jaxspeed.export_params"):
        module = js.export
    assert module.export_params is js.export_params
    with pytest.raises(AttributeError, match="no attribute 'exprot'"):
        js.exprot  # noqa: B018
