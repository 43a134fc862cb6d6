"""Tests for jaxspeed.optim.onebit (1-bit Adam) and jaxspeed.optim.compressed.

The oracle is tests/onebit_reference.py, a plain numpy simulation over N workers. Multi-worker
cases run under `jax.shard_map` over a 1-D ("data",) mesh of the 8 emulated CPU devices, each
worker getting its own gradient (in_specs P("data")).
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import onebit_reference as ref
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.optim.compressed import (
    compressed_allreduce,
    error_feedback_sizes,
    init_error_feedback,
    pack_signs,
    padded_size,
    unpack_signs,
)
from jaxspeed.optim.onebit import OneBitAdamState, onebit_adam, onebit_phase, onebit_state_specs
from numerics import adam_constants_rtol, assert_close, program_rtol

N = 8
# Sizes 3 and 35 are not multiples of 8 * N = 64; 128 is.
SHAPES = {"b": (3,), "k": (16, 8), "w": (5, 7)}
# b2 of the oracle comparisons. optax's float32 bias correction 1 - b2**t (which the
# transform reproduces exactly) magnifies b2's fp32 rounding up to b2 / (1 - b2) times
# (numerics.adam_constants_rtol): ~3e-5 relative with b2 = 0.999, ~3e-6 with 0.99.
B2 = 0.99
#: Against the float64 oracle (tests/numerics.py): a step chains at most 9 reductions (a
#: clipping norm over the 166 values; the mean over the 8 workers or, compressed, the worker's
#: scale over a leaf's at most 128 padded values, the server's average, its scale, the two
#: error updates; the moments, the update), over runs of at most 4 steps; plus Adam's fp32
#: b1 and b2 (0.9 at most here).
ORACLE_RTOL = program_rtol(width=166, depth=9 * 4) + adam_constants_rtol(b1=0.9, b2=B2)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _worker_grads(steps, workers, seed=1):
    """Per step, a dict of float32 `[workers, *shape]`: each worker's own gradient."""
    rng = np.random.default_rng(seed)

    def one(shape):  # workers' gradients differ in scale too
        scale = rng.uniform(0.5, 2.0, size=(workers,) + (1,) * len(shape))
        return (rng.normal(size=(workers, *shape)) * scale).astype(np.float32)

    return [{k: one(s) for k, s in SHAPES.items()} for _ in range(steps)]


def _per_worker(grads, w):
    return {k: g[w] for k, g in grads.items()}


def _f64(tree):
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def _run_sharded(mesh, tx, params, grads_steps, *, freeze_step=None):
    """Runs `tx` for len(grads_steps) updates as a jitted shard_map step over "data".

    The state is created globally (under jax.set_mesh) and sharded with onebit_state_specs.
    `freeze_step`: None = one step that picks the phase with lax.cond; else two static-phase
    steps (`onebit_phase=...`) switched at freeze_step, as the engine runs them.

    Returns:
      (per step `(updates, state)` as numpy trees, {phase: compiled HLO text}).
    """
    with jax.set_mesh(mesh):
        state = tx.init(params)
        specs = onebit_state_specs(state, axis_name="data")
        state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        params = jax.device_put(params, NamedSharding(mesh, P()))

        def make_step(phase):
            def step(params, state, grads):
                grads = jax.tree.map(lambda g: g[0], grads)  # this worker's [1, ...] -> [...]
                extra = {} if phase is None else {"onebit_phase": phase}
                return tx.update(grads, state, params, **extra)

            return jax.jit(
                jax.shard_map(
                    step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
                )
            )

        steps, hlo, history = {}, {}, []
        for count, grads in enumerate(grads_steps):
            phase = None if freeze_step is None else onebit_phase(count, freeze_step=freeze_step)
            if phase not in steps:
                steps[phase] = make_step(phase)
                hlo[phase] = steps[phase].lower(params, state, grads).compile().as_text()
            updates, state = steps[phase](params, state, grads)  # reuses the compiled step
            params = optax.apply_updates(params, updates)
            history.append(jax.tree.map(np.asarray, (updates, state)))
    return history, hlo


def _collectives(hlo: str) -> set[tuple[str, str]]:
    """{(collective, element type)} of the ops in a compiled HLO module."""
    ops = re.findall(
        r"= \(?([a-z0-9]+)\[[^\n]*? (all-to-all|all-gather|all-reduce|reduce-scatter|"
        r"collective-permute)(?:-start)?\(",
        hlo,
    )
    return {(op, dtype) for dtype, op in ops}


def _run_reference(params, grads_steps, workers, **hyper):
    """The numpy oracle on the same per-worker gradients; per step (updates, oracle copy)."""
    oracle = ref.OneBitAdamReference(_f64(params), num_workers=workers, **hyper)
    p = _f64(params)
    out = []
    for grads in grads_steps:
        updates = oracle.step([_per_worker(grads, w) for w in range(workers)], p)
        p = {k: p[k] + updates[k] for k in p}
        worker_errors, server_errors = oracle.flat_errors()
        out.append((updates, dict(oracle.m), dict(oracle.v), worker_errors, server_errors))
    return out


def _assert_matches_reference(history, expected):
    for (updates, state), (r_updates, r_m, r_v, r_ew, r_es) in zip(history, expected):
        assert_close((updates, state.mu, state.nu), (r_updates, r_m, r_v), rtol=ORACLE_RTOL)
        # An error buffer is a difference of the compressed values and their 1-bit code, which
        # cancel (one worker's server gets back its own code: its error is 0 but for rounding).
        # Relative to the size of those terms, the momentum and the errors it carries.
        terms = max(np.abs(x).max() for x in [*jax.tree.leaves(r_m), r_ew, r_es])
        for got, want in ((state.error_worker, r_ew), (state.error_server, r_es)):
            np.testing.assert_allclose(got, want, rtol=ORACLE_RTOL, atol=ORACLE_RTOL * terms)


# ------------------------------------------------------------------------ compression pieces


def test_pack_signs_round_trips_and_matches_numpy_packbits():
    bits = np.random.default_rng(0).random((3, 40)) < 0.5
    packed = jax.jit(pack_signs)(jnp.asarray(bits))
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5)
    np.testing.assert_array_equal(packed, np.packbits(bits, axis=-1))
    np.testing.assert_array_equal(jax.jit(unpack_signs)(packed), np.where(bits, 1.0, -1.0))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(jnp.zeros((3, 7), bool))


def test_padded_sizes():
    assert [padded_size(n, 8) for n in (0, 1, 64, 65, 128)] == [64, 64, 64, 128, 128]
    assert padded_size(35, 1) == 40
    assert error_feedback_sizes(_params(), num_workers=N) == (64 + 128 + 64, (64 + 128 + 64) // 8)
    with pytest.raises(ValueError, match="num_workers"):
        padded_size(3, 0)


def test_compressed_allreduce_single_worker_matches_reference():
    a = np.random.default_rng(2).normal(size=(5, 7)).astype(np.float32)
    a[0, :3] = 0.0  # sign(0) = +1
    x = {"a": jnp.asarray(a)}
    ew, es = init_error_feedback(x, num_workers=1)
    out, ew, es = jax.jit(lambda x, ew, es: compressed_allreduce(x, ew, es, axis_name=None))(
        x, ew, es
    )
    r_out, r_ew, r_es = ref.compressed_allreduce(
        [a.astype(np.float64).reshape(-1)], [np.zeros(40)], [np.zeros(40)]
    )
    assert np.all(np.asarray(out["a"])[0, :3] > 0)
    # fp32 against float64 (tests/numerics.py): the worker's scale over 40 padded values, its
    # error, the server's average, its scale and its error: 5 chained reductions. The errors
    # cancel their terms (the server's to 0 but for rounding): relative to the input's size.
    rtol = program_rtol(width=40, depth=5)
    assert_close(out["a"].reshape(-1), r_out, rtol=rtol)
    for got, want in ((ew, r_ew[0]), (es, r_es[0])):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(a).max())
    with pytest.raises(ValueError, match=r"error_worker of shape \(40,\)"):
        compressed_allreduce(x, jnp.zeros(41), es, axis_name=None)


def test_error_feedback_keeps_running_sums_close(mesh):
    """Over many steps the summed outputs track the summed true averages with a bounded gap."""
    steps, size = 200, 300
    rng = np.random.default_rng(3)
    xs = (rng.normal(size=(steps, N, size)) + rng.normal(size=(1, N, size))).astype(np.float32)

    def run(xs):  # xs: this worker's [steps, 1, size]
        def body(carry, x):
            ew, es = carry
            out, ew, es = compressed_allreduce(x[0], ew, es, axis_name="data")
            zero_ew, zero_es = init_error_feedback(x[0], num_workers=N)
            no_feedback, _, _ = compressed_allreduce(x[0], zero_ew, zero_es, axis_name="data")
            return (ew, es), (out, no_feedback)

        ew, es = init_error_feedback(xs[0, 0], num_workers=N)
        init = jax.lax.pcast((ew, es), "data", to="varying")
        _, outs = jax.lax.scan(body, init, xs)
        return outs

    f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(None, "data"), out_specs=P()))
    out, no_feedback = map(np.asarray, f(xs))
    true_mean = xs.astype(np.float64).mean(axis=1)
    worker_rms = np.sqrt(np.mean(xs.astype(np.float64) ** 2))

    def gap(outputs):  # RMS of (sum of outputs - sum of true averages) after each step
        return np.linalg.norm(np.cumsum(outputs - true_mean, axis=0), axis=1) / np.sqrt(size)

    with_feedback, without = gap(out), gap(no_feedback)
    # The gap is -(mean e_w + e_s): as large as one worker's values, and it does not grow.
    assert with_feedback.max() < 1.5 * worker_rms, (with_feedback.max(), worker_rms)
    assert with_feedback[steps // 2:].max() < 1.5 * with_feedback[: steps // 2].max()
    # Without error feedback the bias of the compression accumulates (about 30x here).
    assert without[-1] > 10 * with_feedback[-1], (without[-1], with_feedback[-1])


# ----------------------------------------------------------------------- 1-bit Adam: warm-up


#: 1-bit Adam's warm-up against optax's Adam, both fp32 with the same fp32 constants
#: (tests/numerics.py): per step the two moments, their bias corrections, the square root,
#: the division, + wd * p and the lr (8 operations of at most 2 terms), chained over 3 steps.
#: Relative to a leaf's largest update: where m_hat / (sqrt(v_hat) + eps) and wd * p nearly
#: cancel, an update is far smaller than its terms.
WARMUP_RTOL = program_rtol(width=2, depth=8 * 3)


@pytest.mark.parametrize("jit, weight_decay", [(False, 0.0), (True, 0.1)])
def test_frozen_beyond_run_equals_optax_adam(jit, weight_decay):
    if weight_decay:  # AdamW with a schedule and the default betas and eps
        lr, hyper = optax.linear_schedule(1e-2, 1e-3, transition_steps=10), {}
        expected_tx = optax.adamw(lr, weight_decay=weight_decay)
    else:
        lr, hyper = 1e-2, dict(b1=0.8, b2=0.99, eps=1e-6)
        expected_tx = optax.adam(lr, **hyper)
    tx = onebit_adam(lr, **hyper, weight_decay=weight_decay, freeze_step=1000)
    update = jax.jit(tx.update) if jit else tx.update
    expected_update = jax.jit(expected_tx.update) if jit else expected_tx.update
    params = jax.tree.map(jnp.asarray, _params())
    state, expected_state = tx.init(params), expected_tx.init(params)
    for grads in _worker_grads(3, 1):
        grads = _per_worker(grads, 0)
        updates, state = update(grads, state, params)
        expected, expected_state = expected_update(grads, expected_state, params)
        assert_close(updates, expected, rtol=WARMUP_RTOL)
        params = optax.apply_updates(params, updates)


def test_frozen_beyond_run_equals_optax_adam_in_shard_map(mesh):
    params = _params()
    grads_steps = _worker_grads(3, N)
    tx = onebit_adam(1e-2, weight_decay=0.05, freeze_step=1000, axis_name="data")
    history, _ = _run_sharded(mesh, tx, params, grads_steps, freeze_step=1000)
    expected_tx = optax.adamw(1e-2, weight_decay=0.05)
    expected_update = jax.jit(expected_tx.update)
    p = jax.tree.map(jnp.asarray, params)
    state = expected_tx.init(p)
    for (updates, _), grads in zip(history, grads_steps):
        mean = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        expected, state = expected_update(mean, state, p)
        # The all-reduce averages the 8 workers in another order than jnp.mean.
        assert_close(updates, expected, rtol=program_rtol(width=8, depth=8 * 3))
        p = optax.apply_updates(p, expected)


# ------------------------------------------------------------------- 1-bit Adam: compression

HYPER = dict(learning_rate=1e-2, b2=B2, weight_decay=0.01, freeze_step=2)


@pytest.fixture(scope="module")
def two_phase_run(mesh):
    """2 warm-up + 2 compressed updates over 8 workers with the two static-phase steps."""
    params, grads_steps = _params(), _worker_grads(4, N)
    tx = onebit_adam(**HYPER, axis_name="data")
    history, hlo = _run_sharded(mesh, tx, params, grads_steps, freeze_step=HYPER["freeze_step"])
    return history, hlo, _run_reference(params, grads_steps, N, **HYPER)


def test_compressed_steps_match_numpy_workers(two_phase_run):
    """Updates, m, v, e_w and e_s of every worker match the numpy simulation, every step."""
    history, _, expected = two_phase_run
    _assert_matches_reference(history, expected)
    worker_errors = history[-1][1].error_worker
    assert worker_errors.shape == (N, 256)
    assert not np.allclose(worker_errors[0], worker_errors[1])  # the workers' own errors


def test_variance_is_frozen_after_freeze_step(two_phase_run):
    history, _, _ = two_phase_run
    assert not np.allclose(history[1][1].nu["k"], history[0][1].nu["k"])
    for _, state in history[2:]:
        chex.assert_trees_all_equal(state.nu, history[1][1].nu)


def test_post_freeze_step_communicates_only_packed_bits(two_phase_run):
    """The compressed step's collectives are one all-to-all and one all-gather of uint8."""
    _, hlo, _ = two_phase_run
    assert _collectives(hlo["compressed"]) == {("all-to-all", "u8"), ("all-gather", "u8")}
    assert ("all-reduce", "f32") in _collectives(hlo["warmup"])


def test_single_worker_is_the_one_worker_simulation():
    """axis_name=None, lax.cond phase choice under jit, no bias correction."""
    params, grads_steps = _params(), _worker_grads(4, 1)
    hyper = dict(learning_rate=1e-2, b1=0.8, b2=B2, freeze_step=2, bias_correction=False)
    tx = onebit_adam(**hyper)
    update = jax.jit(tx.update)
    state, p = tx.init(params), jax.tree.map(jnp.asarray, params)
    history = []
    for grads in grads_steps:
        updates, state = update(_per_worker(grads, 0), state, p)
        p = optax.apply_updates(p, updates)
        history.append(jax.tree.map(np.asarray, (updates, state)))
    assert state.error_worker.shape == (1, 8 + 128 + 40)
    _assert_matches_reference(history, _run_reference(params, grads_steps, 1, **hyper))


def test_chain_after_clip_sees_local_gradients(mesh):
    """optax.chain(clip, onebit_adam) in shard_map, phase by lax.cond: local clipping."""
    params, grads_steps = _params(), _worker_grads(3, N)
    hyper = dict(learning_rate=1e-2, b2=B2, freeze_step=1)
    tx = optax.chain(optax.clip_by_global_norm(2.0), onebit_adam(**hyper, axis_name="data"))
    history, _ = _run_sharded(mesh, tx, params, grads_steps)

    def clipped(grads):  # each worker clips its own gradient by its own global norm
        out = {k: g.astype(np.float64) for k, g in grads.items()}
        for w in range(N):
            norm = np.sqrt(sum(np.sum(g[w] ** 2) for g in out.values()))
            for g in out.values():
                g[w] *= min(1.0, 2.0 / norm)
        return out

    expected = _run_reference(params, [clipped(g) for g in grads_steps], N, **hyper)
    _assert_matches_reference([(u, s[1]) for u, s in history], expected)


# ---------------------------------------------------------------------------- state, errors


def test_state_is_global_outside_and_local_inside_shard_map(mesh):
    params, grads = _params(), _worker_grads(1, N)[0]
    tx = optax.chain(optax.clip(1.0), onebit_adam(1e-3, axis_name="data"))

    def init_and_update(params, grads):  # a fresh (replicated-typed) state through lax.cond
        state = tx.init(params)
        return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)

    with jax.set_mesh(mesh):
        global_state = jax.eval_shape(tx.init, params)
        specs = onebit_state_specs(global_state, axis_name="data")
        local_state = jax.eval_shape(
            jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs), params
        )
        _, updated_state = jax.eval_shape(
            jax.shard_map(
                init_and_update, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), specs)
            ),
            params,
            grads,
        )
    assert isinstance(global_state[1], OneBitAdamState)
    assert global_state[1].error_worker.shape == (N, 256)
    assert global_state[1].error_server.shape == (N, 32)
    chex.assert_trees_all_equal_shapes_and_dtypes(local_state, global_state)
    chex.assert_trees_all_equal_shapes_and_dtypes(updated_state, global_state)
    assert specs[1].error_worker == P("data") and specs[1].error_server == P("data")
    assert specs[1].count == P() and specs[1].mu["w"] == P() and specs[0] == optax.EmptyState()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(freeze_step=-1), "freeze_step"),
        (dict(freeze_step=2.5), "freeze_step"),
        (dict(b1=1.0), "b1"),
        (dict(eps=-1.0), "eps"),
        (dict(axis_name=3), "axis_name"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        onebit_adam(1e-3, **kwargs)


def test_unbound_axis_and_bad_phase_raise(mesh):
    params = jax.tree.map(jnp.asarray, _params())
    grads = _per_worker(_worker_grads(1, 1)[0], 0)
    tx = onebit_adam(1e-3, axis_name="data")
    with pytest.raises(ValueError, match="axis_name='data'"):
        tx.init(params)  # no shard_map, no mesh
    with jax.set_mesh(mesh):
        state = tx.init(params)
    with pytest.raises(ValueError, match="axis_name='data' is not bound"):
        tx.update(grads, state, params)
    local = onebit_adam(1e-3)
    chained = optax.chain(optax.clip(1.0), local)
    with pytest.raises(ValueError, match="onebit_phase='later'"):
        chained.update(grads, chained.init(params), params, onebit_phase="later")
    with pytest.raises(ValueError, match=r"error_worker has shape \(8, 256\)"):
        local.update(grads, state, params)  # a global 8-worker state on one worker
