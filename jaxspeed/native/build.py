"""Builds, caches and registers jaxspeed's native XLA:CPU kernels (`matmul.cc`).

The C++ source is compiled on first use with the system's C++ compiler against JAX's FFI
headers (`jax.ffi.include_dir()`) and the OpenBLAS of the `scipy-openblas32` wheel. The
library lands in a cache folder keyed by a hash of everything that goes into it, so a later
process (or another pytest worker) loads it without compiling; two processes compiling at once
each write their own file and the last `os.replace` wins.

When anything is missing (no compiler, no OpenBLAS, a compile error), the kernels are simply
unavailable: callers fall back to XLA's own ops, with one warning that says why.

Loading the library sets the `scipy-openblas32` OpenBLAS to one thread (the kernels spread
their GEMMs over XLA's thread pool instead). NumPy and SciPy bundle OpenBLAS copies of their
own, which this does not touch.

Environment:
  JAXSPEED_NATIVE=0    never build or use the native kernels (XLA's dot everywhere).
  JAXSPEED_CACHE_DIR   where the compiled library goes (default `~/.cache/jaxspeed`).
  CXX                  the compiler (default `c++`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax

SOURCE = Path(__file__).with_name("matmul.cc")
#: FFI target names (CPU platform) of the kernels in `matmul.cc`.
BATCHED = "jaxspeed_batched_matmul"
GROUPED = "jaxspeed_grouped_matmul"
GROUPED_OUTER = "jaxspeed_grouped_outer"
_SYMBOLS = {BATCHED: "JaxspeedBatchedMatmul", GROUPED: "JaxspeedGroupedMatmul",
            GROUPED_OUTER: "JaxspeedGroupedOuter"}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def enabled() -> bool:
    """False when `JAXSPEED_NATIVE=0` (or `false`/`off`) turns the native kernels off."""
    return os.environ.get("JAXSPEED_NATIVE", "1").strip().lower() not in ("0", "false", "off")


def cache_dir() -> Path:
    """`$JAXSPEED_CACHE_DIR`, else `~/.cache/jaxspeed`."""
    return Path(os.environ.get("JAXSPEED_CACHE_DIR") or Path.home() / ".cache" / "jaxspeed")


def _openblas():
    """(include dir, lib dir, link name, version) of the `scipy-openblas32` wheel."""
    try:
        import scipy_openblas32 as blas
    except ImportError as e:
        raise NativeUnavailable(f"the scipy-openblas32 package is not installed ({e})") from e
    return blas.get_include_dir(), blas.get_lib_dir(), blas.get_library(), blas.__version__


def compile_command(output: Path) -> list[str]:
    """The compiler command line that builds the library into `output`."""
    include, libdir, libname, _ = _openblas()
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    return [*compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{include}", str(SOURCE),
            "-o", str(output), f"-L{libdir}", f"-l{libname}", f"-Wl,-rpath,{libdir}"]


def library_path() -> Path:
    """Where the library for this source, JAX, OpenBLAS and compiler lives in the cache."""
    _, _, _, blas_version = _openblas()
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jax.__version__.encode(), blas_version.encode(),
                 os.environ.get("CXX", "c++").encode(), " ".join(_FLAGS).encode()):
        key.update(part + b"\0")
    return cache_dir() / "native" / f"matmul-{key.hexdigest()[:16]}.so"


def build(path: Path) -> Path:
    """Compiles the library to `path` (atomically), raising `NativeUnavailable` on failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=path.parent)
    except OSError as e:
        raise NativeUnavailable(f"cannot write to the cache folder {path.parent} ({e}); "
                                f"point JAXSPEED_CACHE_DIR at a writable folder") from e
    os.close(fd)
    try:
        try:
            done = subprocess.run(compile_command(Path(tmp)), capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeUnavailable(f"the C++ compiler could not run ({e})") from e
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise NativeUnavailable(f"compiling {SOURCE.name} failed:\n{tail}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load() -> ctypes.CDLL:
    """Builds (once per cache) and loads the library, and registers its FFI target on CPU."""
    if not enabled():
        raise NativeUnavailable("JAXSPEED_NATIVE=0 turns the native kernels off")
    path = library_path()
    if not path.exists():
        build(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"loading {path} failed ({e})") from e
    for target, symbol in _SYMBOLS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return lib


def available() -> bool:
    """Whether the native kernels are on and usable (`JAXSPEED_NATIVE` is read every call)."""
    return enabled() and _loads()


@functools.cache
def _loads() -> bool:
    """Whether `load()` succeeds; its first failure is reported once, as a warning."""
    try:
        load()
    except NativeUnavailable as e:
        warnings.warn(f"jaxspeed's native CPU kernels are unavailable, XLA's own ops are used "
                      f"instead: {e}", RuntimeWarning, stacklevel=3)
        return False
    return True
