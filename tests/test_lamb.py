"""LAMB and 1-bit LAMB: the transforms against step-by-step references, and 1-bit LAMB in the
engine (LAMB before the freeze, only compressed traffic after, convergence beside LAMB)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_onebit_engine import FREEZE, config, convergence_engine, convergence_gaps, run

import jaxspeed as js
from jaxspeed.cost.hlo import collective_bytes
from jaxspeed.errors import ConfigError
from jaxspeed.models.gpt import count_params
from jaxspeed.optim import lamb, onebit_lamb
from jaxspeed.optim.compressed import compressed_allreduce

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.1, 0.01
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "b": jnp.full((8,), 1e-3)}


def grads(i):
    return jax.tree.map(lambda p: jnp.cos(p * (i + 2.0)) + 0.1 * i, PARAMS)


def reference_ratio(p, u, lo, hi):
    pn, un = np.linalg.norm(p), np.linalg.norm(u)
    return float(np.clip(pn / un if pn > 0 and un > 0 else 1.0, lo, hi))


def run_tx(tx, steps):
    state, params, states = tx.init(PARAMS), PARAMS, []
    for i in range(steps):
        updates, state = jax.jit(tx.update)(grads(i), state, params)
        params = optax.apply_updates(params, updates)
        states.append(state)
    return params, states


def test_lamb_equals_a_step_by_step_reference_with_clamping():
    """max_coeff 2: the small `b` leaf's ratio ||p|| / ||u|| is far below 0.01 → clamped up;
    `w`'s is between the bounds."""
    got, _ = run_tx(lamb(LR, weight_decay=WD, max_coeff=2.0, min_coeff=0.05), 3)
    params = jax.tree.map(np.asarray, PARAMS)
    m = jax.tree.map(np.zeros_like, params)
    v = jax.tree.map(np.zeros_like, params)
    for t in range(1, 4):
        g = jax.tree.map(np.asarray, grads(t - 1))
        for k in params:
            m[k] = B1 * m[k] + (1 - B1) * g[k]
            v[k] = B2 * v[k] + (1 - B2) * g[k] ** 2
            u = (m[k] / (1 - B1**t)) / (np.sqrt(v[k] / (1 - B2**t)) + EPS) + WD * params[k]
            params[k] = params[k] - LR * reference_ratio(params[k], u, 0.05, 2.0) * u
    chex.assert_trees_all_close(got, params, rtol=1e-5, atol=1e-7)


def test_onebit_lamb_before_its_freeze_is_lamb():
    want, _ = run_tx(lamb(LR, weight_decay=WD), 5)
    got, _ = run_tx(onebit_lamb(LR, weight_decay=WD, freeze_step=100), 5)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_onebit_lamb_compressed_steps_follow_the_algorithm():
    """Two warm-up steps, then three compressed ones, one worker, against a reference built
    from the same compressed all-reduce: frozen variance and averaged ratio, the fresh variance
    from the rebuilt gradient, the factor's threshold and clip."""
    kw = dict(weight_decay=WD, freeze_step=2, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
              factor_threshold=0.1)
    got, states = run_tx(onebit_lamb(LR, **kw), 5)
    warm = states[1]
    params = jax.tree.map(np.asarray, run_tx(onebit_lamb(LR, **kw), 2)[0])
    m, v = jax.tree.map(np.asarray, warm.mu), jax.tree.map(np.asarray, warm.nu)
    fresh, last = dict(v), {k: 1.0 for k in params}
    coeff = {k: float(warm.coeff_freeze[k]) / (1 - 0.9**2) for k in params}
    ew, es = warm.error_worker[0], warm.error_server[0]
    for t in range(3, 6):
        local = jax.tree.map(lambda mu, g: B1 * mu + (1 - B1) * np.asarray(g), m, grads(t - 1))
        avg, ew, es = compressed_allreduce(jax.tree.map(jnp.asarray, local), ew, es, axis_name=None)
        avg = jax.tree.map(np.asarray, avg)
        for k in params:
            fresh[k] = B2 * fresh[k] + (1 - B2) * ((avg[k] - B1 * m[k]) / (1 - B1)) ** 2
            denom = np.sqrt(v[k] / (1 - B2**2)) + EPS
            factor = np.max(denom / (np.sqrt(fresh[k] / (1 - B2**2)) + EPS))
            prelim = (avg[k] / (1 - B1**t)) / denom
            u = prelim + WD * params[k]
            share = min(1.0, np.linalg.norm(prelim) / np.linalg.norm(u))
            factor = factor * share + (1 - share)
            factor = np.clip(np.clip(factor, 0.5, 4.0), last[k] * 0.9, last[k] * 1.1)
            last[k] = factor
            params[k] = params[k] - LR * coeff[k] * factor * u
        m = avg
    chex.assert_trees_all_close(got, params, rtol=2e-5, atol=1e-7)
    assert all(float(f) != 1.0 for f in jax.tree.leaves(states[-1].last_factor))


@pytest.mark.parametrize("params,match", [
    ("{factor_min: 2.0}", "factor_min"),
    ("{max_coeff: 0.001}", "max_coeff"),
])
def test_bad_parameters_are_one_line_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        js.initialize(config("optimizer.type=OneBitLamb", f"optimizer.params={params}"))


#: the convergence test's optimizers (`convergence_engine`'s arguments), frozen at a third
LAMB = ("Lamb", "lr: 0.01")
ONEBIT_LAMB = ("OneBitLamb", f"lr: 0.01, freeze_step: {FREEZE}, factor_min: 1.0, factor_max: 1.0")


def test_engine_before_the_freeze_is_lamb_and_after_it_moves_only_compressed_bytes():
    """The convergence test's engines (their steps compiled once for both tests): 8 warm-up
    steps (the lr ramping up to 0.0035) equal LAMB's; the compressed step moves no fp32
    gradient, and runs."""
    lamb_engine, onebit = (convergence_engine(*optimizer) for optimizer in (LAMB, ONEBIT_LAMB))
    want, want_losses = run(lamb_engine, lamb_engine.init(jax.random.key(0)), 0, 8)
    got, losses = run(onebit, onebit.init(jax.random.key(0)), 0, 8)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-6, atol=2e-6)
    grad_bytes = 4 * count_params(onebit.abstract_state().params)
    compressed = collective_bytes(onebit.compile_train_step(step=FREEZE).as_text(),
                                  num_devices=8)
    assert compressed["all-reduce"] <= 16  # the loss and grad-norm scalars
    assert 0 < compressed["total"] < grad_bytes / 8
    _, after = run(onebit, got, 8, FREEZE - 8 + 3)  # through the freeze: 3 compressed steps
    assert np.all(np.isfinite(after))


@pytest.mark.slow
def test_converges_like_lamb_with_the_drift_factor_pinned():
    """120 steps, freeze at a third, 3 seeds (the 1-bit Adam test's schedule, model and
    measure): with `factor_min = factor_max = 1` the mean gap of the final loss to LAMB's is
    within 2.5%.

    Measured (jax 0.12, AMD EPYC AVX2; -O0 and XLA's default level alike): pinned, per seed
    +0.8%, +0.6%, -0.6%, -0.1% on seeds 0-3 (mean over 0, 1, 2: +0.3%). Broken, without server
    error feedback: -8.2%, -1.9%, -5.8%, -5.9% (three consecutive seeds average -4.5% or
    further: the bound is two-sided). With DeepSpeed's default factor bounds (0.5, 4): +4.6%,
    +4.7%, +3.6% (mean +4.3%): on this tiny model the momentum rebuilt from the compressed
    average is noisy, the "fresh" variance grows, and the factor max(denom_frozen /
    denom_fresh) settles below 1 (shorter steps). 2.5% lies between. (The 300-step two-layer
    run this replaced: pinned +2.7%, default bounds +12.7% and +12.4% on seeds 0 and 1, which
    the README states.)
    """
    gaps = convergence_gaps(LAMB, ONEBIT_LAMB)
    assert abs(np.mean(gaps)) <= 0.025, np.round(gaps, 4).tolist()
