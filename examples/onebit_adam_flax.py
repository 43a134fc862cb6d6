"""1-bit Adam in your own training loop: plain Flax + optax + `jax.shard_map`, no engine.

Each data-parallel worker computes the gradient of its own rows and hands it to
`js.optim.onebit_adam(..., axis_name="data")`. Before `freeze_step` the transform averages the
gradients with a full-precision `pmean`; after it, only the 1-bit compressed momentum crosses
the network. Two jitted steps, one per phase, so neither program carries the other's
collectives.

    python examples/onebit_adam_flax.py                 # 8 emulated CPU devices
    python examples/onebit_adam_flax.py --steps 50 --freeze-step 10
"""

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspeed as js
from jaxspeed.optim.onebit import onebit_phase, onebit_state_specs


class MLP(nn.Module):
    """A two-layer regression model."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.gelu(nn.Dense(64)(x)))


def train_step(model, tx, phase, params, opt_state, x, y):
    """Runs inside `shard_map`: `x`, `y` are this worker's rows."""
    # Differentiate w.r.t. a *varying* copy of the replicated params: otherwise shard_map's
    # transpose would all-reduce the gradient, and the compression would save nothing.
    local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(local)
    updates, opt_state = tx.update(grads, opt_state, params, onebit_phase=phase)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--freeze-step", type=int, default=5)
    parser.add_argument("--cpu-devices", type=int, default=8)
    args = parser.parse_args()
    if args.cpu_devices:  # before any JAX computation: the device count is fixed at start-up
        jax.config.update("jax_platforms", "cpu")
        js.distributed.set_cpu_devices(args.cpu_devices)

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    model = MLP()
    tx = js.optim.onebit_adam(1e-2, freeze_step=args.freeze_step, axis_name="data")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * 32, 16)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)

    with jax.set_mesh(mesh):  # init sizes the per-worker error buffers from the mesh
        params = model.init(jax.random.key(0), x[:1])
        opt_state = tx.init(params)
    opt_specs = onebit_state_specs(opt_state, axis_name="data")  # error buffers: one per worker
    opt_state = jax.device_put(opt_state, jax.tree.map(lambda s: NamedSharding(mesh, s), opt_specs))
    param_specs = jax.tree.map(lambda _: P(), params)
    steps = {
        phase: jax.jit(jax.shard_map(
            functools.partial(train_step, model, tx, phase), mesh=mesh,
            in_specs=(param_specs, opt_specs, P("data"), P("data")),
            out_specs=(param_specs, opt_specs, P()),
        ))
        for phase in ("warmup", "compressed")
    }
    for step in range(args.steps):
        phase = onebit_phase(step, freeze_step=args.freeze_step)
        params, opt_state, loss = steps[phase](params, opt_state, x, y)
        print(f"step {step + 1:4d} loss {float(loss):.5f} ({phase})")


if __name__ == "__main__":
    main()
