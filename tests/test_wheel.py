"""What an installed wheel needs: every data file the package reads ships as package data (the
cluster presets included), and `jaxspeed bench` outside a checkout is one line. `make
test-wheel` (`tools/test_wheel.sh`) builds the wheel and runs it from a clean venv."""

import fnmatch
import tomllib
from pathlib import Path

import jaxspeed
from jaxspeed.cli import main, run
from jaxspeed.config.cluster import PRESETS, available_presets

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(jaxspeed.__file__).resolve().parent


def _package_data() -> list[str]:
    """pyproject's package-data globs, as paths from the repository root."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    return [f"{package.replace('.', '/')}/{glob}" for package, globs in data.items() for glob in globs]


def test_cluster_presets_are_package_data():
    assert PRESETS.is_relative_to(PACKAGE), PRESETS
    assert "8xh100-nvlink" in available_presets()
    shipped = _package_data()
    for preset in PRESETS.glob("*.yaml"):
        path = preset.relative_to(ROOT).as_posix()
        assert any(fnmatch.fnmatch(path, glob) for glob in shipped), (path, shipped)


def test_every_data_file_of_the_package_ships():
    shipped = _package_data()
    data = [p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "the package has data files (GPU targets, cluster presets)"
    unshipped = [p for p in data if not any(fnmatch.fnmatch(p, glob) for glob in shipped)]
    assert not unshipped, f"not in [tool.setuptools.package-data]: {unshipped}"


def test_bench_outside_a_checkout_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run, "BENCHMARKS", tmp_path / "no-benchmarks")
    assert main(["bench", "throughput", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "source checkout" in err and "pip install -e" in err, err
