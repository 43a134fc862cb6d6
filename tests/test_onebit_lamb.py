"""1-bit LAMB over 8 workers (tests/test_lamb.py has the one-worker algorithm and the engine)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_close, program_rtol
from test_zero_one_adam import PARAMS, grads_at

from jaxspeed.cost.hlo import collective_bytes
from jaxspeed.optim import onebit_lamb
from jaxspeed.optim.onebit import COMPRESSED, WARMUP, onebit_phase, onebit_state_specs

HYPER = dict(learning_rate=0.01, weight_decay=0.1, freeze_step=3, factor_threshold=0.2)
STEPS = 7


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def test_eight_workers_with_one_gradient_are_one_worker(mesh):
    """Every worker sees the same gradients (leaves of 64 k values: no padding over 8 workers
    or 1), so the compressed average is each worker's own code and the 8-worker run is the
    one-worker run; warm-up moves fp32 gradients, the compressed phase only packed bits."""
    tx = onebit_lamb(**HYPER, axis_name="data")
    with jax.set_mesh(mesh):
        state = tx.init(PARAMS)
        specs = onebit_state_specs(state, axis_name="data")
        state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

        def step(phase):
            def local(params, state):
                return tx.update(grads_at(state.count, params), state, params, onebit_phase=phase)
            return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs),
                                         out_specs=(P(), specs)))

        steps = {phase: step(phase) for phase in (WARMUP, COMPRESSED)}
        params, got, moved = PARAMS, [], {}
        for count in range(STEPS):
            phase = onebit_phase(count, freeze_step=HYPER["freeze_step"])
            moved.setdefault(phase, collective_bytes(
                steps[phase].lower(params, state).compile().as_text(), num_devices=8))
            updates, state = steps[phase](params, state)
            params = optax.apply_updates(params, updates)
            got.append(jax.tree.map(np.asarray, params))
    one = onebit_lamb(**HYPER)
    params, state = PARAMS, one.init(PARAMS)
    update = jax.jit(one.update)
    for count in range(STEPS):
        updates, state = update(grads_at(count, params), state, params)
        params = optax.apply_updates(params, updates)
        # 8 equal terms summed in another order, through the ratio's and the factor's norms
        assert_close(got[count], jax.tree.map(np.asarray, params),
                     rtol=program_rtol(width=128, depth=10 * (count + 1)))
    grad_bytes = 4 * (128 + 64)
    assert moved[WARMUP]["all-reduce"] >= grad_bytes
    assert moved[COMPRESSED]["all-reduce"] == 0
    assert 0 < moved[COMPRESSED]["all-to-all"] < grad_bytes / 8
