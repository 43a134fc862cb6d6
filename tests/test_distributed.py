"""`jaxspeed.distributed.initialize` as the README shows it: alone on one machine it runs as one
process; asked for a cluster (`require_cluster`, the CLI's `--distributed`) it says none is there.

Each case runs in a fresh interpreter: `jax.distributed` starts at most once per process, and
only before JAX's backend.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: variables through which a launcher or cluster tells JAX where a process stands
CLUSTER_PREFIXES = ("JAXSPEED_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_COORDINATOR", "TPU_",
                    "CLOUD_TPU", "MEGASCALE_")


@pytest.fixture
def alone():
    """The environment of a process on one machine: no launcher, no cluster, 2 CPU devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_PREFIXES)}
    env.pop("XLA_FLAGS", None)
    return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}


def run(env, body):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_initialize_as_the_readme_shows_runs_alone_on_one_machine(alone):
    proc = run(alone, """
        import json
        import jaxspeed as js
        started = js.distributed.initialize()   # the README's line
        import jax, jax.numpy as jnp
        total = float(jax.jit(lambda x: x.sum())(jnp.arange(4.0)))
        print(json.dumps({"started": started, "processes": jax.process_count(),
                          "devices": jax.device_count(), "total": total}))
    """)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "started": False, "processes": 1, "devices": 2, "total": 6.0}


def test_require_cluster_without_one_is_one_clear_error(alone):
    proc = run(alone, """
        from jaxspeed.errors import JaxspeedError
        from jaxspeed.runtime.distributed import initialize
        try:
            initialize(require_cluster=True)
        except JaxspeedError as err:
            print(err)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("jax.distributed.initialize failed (cluster auto-detection, timeout "
                           "300 s): coordinator_address should be defined.\n")
