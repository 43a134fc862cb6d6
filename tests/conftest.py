"""Test setup: 8 emulated CPU devices, set before JAX is imported anywhere.

The tests compile hundreds of small programs, and on CPU compiling is most of their time, so
XLA's backend optimizations and fusion emitters are off (about 3x faster, measured on
tests/test_pipeline_engine.py: 117 s against 411 s). SPMD partitioning, and so every sharding
and collective, is unaffected, and the tests that compare compiled memory sizes (remat,
pipeline schedules, offload, fit) hold at this level too. Subprocesses (examples,
benchmarks, the CLI) inherit these flags.
"""

import os

#: XLA flags that make compiling fast.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
