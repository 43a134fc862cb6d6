"""Modules that moved into packages keep their old import paths for one release."""

import importlib
import subprocess
import sys

import pytest

from jaxspeed import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_path_is_the_new_module_with_a_warning(old):
    new = importlib.import_module(_moved.MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {_moved.MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is new


def test_submodule_of_a_moved_package_is_not_loaded_twice():
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import jaxspeed.hf.config as old, jaxspeed.checkpoint.hf.config as new\n"
        "assert old is new, (old, new)\n"
        "from jaxspeed.engine import initialize\n"
        "import jaxspeed.train.engine as engine\n"
        "assert initialize is engine.initialize\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_new_modules_are_not_aliased():
    assert _moved.new_name("jaxspeed.train.engine") is None
    assert _moved.new_name("jaxspeed.data") is None  # a package now, with the same names
    assert _moved.new_name("jaxspeed.enginex") is None


def test_old_module_attributes_of_the_package_resolve():
    import jaxspeed as js
    import jaxspeed.runtime.mesh

    with pytest.warns(DeprecationWarning, match="jaxspeed.mesh moved to jaxspeed.runtime.mesh"):
        sys.modules.pop("jaxspeed.mesh", None)
        vars(js).pop("mesh", None)
        assert js.mesh is jaxspeed.runtime.mesh
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        js.nonesuch
