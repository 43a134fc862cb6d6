"""`benchmarks/tokamax_compare.py`: `--cpu-check` compares ours with tokamax's `xla`
implementations at tiny sizes where tokamax is installed, and says it is missing (exit 0)
where it is not (CI: tokamax is no dependency of jaxspeed)."""

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from test_benchmarks import ROOT, check_result, load_benchmark


def test_cpu_check_runs_or_says_tokamax_is_missing():
    proc = subprocess.run([sys.executable, "benchmarks/tokamax_compare.py", "--cpu-check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if importlib.util.find_spec("tokamax") is None:
        assert "tokamax is missing" in proc.stdout
        return
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    measured = [line for line in lines if "skipped" not in line]
    for line in measured:
        check_result(line, "tokamax_compare")
        assert line["max_rel_diff"] <= load_benchmark("tokamax_compare").TOLERANCE
    cases = " ".join(line["case"] for line in measured)
    for name in ("jaxspeed blocked", "tokamax xla", "tokamax xla_chunked",
                 "jaxspeed grouped_matmul", "jax.lax.ragged_dot"):
        assert name in cases, (name, cases)
    assert lines[-1]["case"].startswith("headline, fastest tokamax attention")


def test_references_match_jax():
    bench = load_benchmark("tokamax_compare")
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (2, 16, 4, 8))
    k, v = (jax.random.normal(key, (2, 16, 2, 8)) for key in keys[1:3])
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(bench.reference_attention(q, k, v), want, rtol=1e-5, atol=1e-5)
    lhs, rhs = jax.random.normal(keys[3], (12, 8)), jax.random.normal(keys[4], (3, 8, 5))
    sizes = jnp.array([5, 0, 7], jnp.int32)
    np.testing.assert_allclose(bench.reference_ragged(lhs, rhs, sizes),
                               jax.lax.ragged_dot(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
