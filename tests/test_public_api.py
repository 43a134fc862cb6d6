"""The public surface: the README's "Public API" table is `jaxspeed.__all__`, typed; and no
library call changes the process behind the caller's back (the host allocator is opt-in)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

import jaxspeed as js
from jaxspeed.runtime import host_allocator

ROOT = Path(__file__).resolve().parents[1]
PAGES_64_MIB = (64 << 20) // 4096
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


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


#: Frees and re-allocates a 64 MiB block ten times, touching every page: the minor page faults
#: of the last nine rounds (glibc's defaults mmap such a block afresh each time).
_PROBE = textwrap.dedent("""
    import ctypes, resource

    def faults():
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        size, total = 64 << 20, 0
        for round_ in range(10):
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = libc.malloc(size)
            ctypes.memset(block, 1, size)
            libc.free(block)
            if round_:
                total += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
        return total // 9
""")


def _run(script: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", _PROBE + textwrap.dedent(script)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@linux_only
def test_initialize_leaves_the_allocator_alone_and_the_opt_in_changes_it():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", host_allocator.ENV: "cache"}
    env.pop("GLIBC_TUNABLES", None)
    out = json.loads(_run("""
        import json
        import jaxspeed as js
        from jaxspeed.runtime.host_allocator import applied
        js.initialize("configs/gpt_tiny.yaml")
        before, applied_before = faults(), applied()
        said = js.keep_freed_memory()
        print(json.dumps({"before": before, "applied_before": applied_before, "said": said,
                          "after": faults()}))
    """, env))
    assert out["applied_before"] is None and out["before"] > PAGES_64_MIB // 2, out
    assert out["said"] == host_allocator.CACHED and out["after"] < PAGES_64_MIB // 16, out


def test_the_tunables_say_what_mallopt_sets():
    assert host_allocator.TUNABLES == (
        "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1")


def test_child_env_adds_the_tunables_only_when_this_process_keeps_freed_memory(monkeypatch):
    monkeypatch.setattr(host_allocator, "applied", lambda: None)
    assert host_allocator.child_env({"A": "1"}) == {"A": "1"}
    monkeypatch.setattr(host_allocator, "applied", lambda: "system allocator (no glibc here)")
    assert host_allocator.child_env({"A": "1"}) == {"A": "1"}
    monkeypatch.setattr(host_allocator, "applied", lambda: host_allocator.CACHED)
    env = host_allocator.child_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:" + host_allocator.TUNABLES}


@linux_only
def test_a_child_started_with_the_tunables_keeps_freed_memory(monkeypatch):
    monkeypatch.setattr(host_allocator, "applied", lambda: host_allocator.CACHED)
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert int(_run("print(faults())", host_allocator.child_env(base))) < PAGES_64_MIB // 16
    assert int(_run("print(faults())", base)) > PAGES_64_MIB // 2
