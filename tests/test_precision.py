"""Tests for jaxspeed.ops.precision: dtype policy and DeepSpeed's dynamic loss scaling."""

import functools
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.errors import ConfigError
from jaxspeed.ops.precision import (
    LossScaleState,
    all_finite,
    cast_floating,
    compute_dtype,
    init_loss_scale,
    loss_scale_options,
    scale_loss,
    select_tree,
    unscale_grads,
    update_loss_scale,
)


def _precision_config(bf16, fp16):
    return SimpleNamespace(bf16=SimpleNamespace(enabled=bf16), fp16=SimpleNamespace(enabled=fp16))


@pytest.mark.parametrize(
    "bf16, fp16, dtype",
    [(True, False, jnp.bfloat16), (False, True, jnp.float16), (False, False, jnp.float32)],
)
def test_compute_dtype(bf16, fp16, dtype):
    assert compute_dtype(_precision_config(bf16, fp16)) == jnp.dtype(dtype)


def test_compute_dtype_rejects_both():
    with pytest.raises(ConfigError, match="bf16.enabled and fp16.enabled"):
        compute_dtype(_precision_config(True, True))


def test_cast_floating_keeps_ints():
    tree = {"w": jnp.ones((2, 3), jnp.float32), "step": jnp.int32(3), "ids": jnp.arange(4)}
    out = cast_floating(tree, jnp.bfloat16)
    assert out["w"].dtype == jnp.bfloat16
    assert out["step"].dtype == jnp.int32
    assert out["ids"].dtype == tree["ids"].dtype
    chex.assert_trees_all_equal(out["ids"], tree["ids"])


def test_all_finite():
    good = {"a": jnp.ones(3), "b": jnp.arange(3)}
    assert bool(jax.jit(all_finite)(good))
    assert not bool(jax.jit(all_finite)({**good, "c": jnp.array([1.0, jnp.inf])}))
    assert not bool(jax.jit(all_finite)({**good, "c": jnp.array([jnp.nan], jnp.bfloat16)}))
    assert bool(all_finite({}))


def _fp16_cfg(**overrides):
    cfg = dict(
        initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0,
        consecutive_hysteresis=False,
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def _run(cfg, finite_seq):
    """Runs the jitted update over `finite_seq`; returns [(scale, good_steps, hysteresis)]."""
    update = jax.jit(functools.partial(update_loss_scale, **loss_scale_options(cfg)))
    state = init_loss_scale(cfg)
    out = []
    for finite in finite_seq:
        state = update(state, jnp.asarray(finite))
        out.append((float(state.scale), int(state.good_steps), int(state.hysteresis)))
    return out


class _DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, written plainly (no min-scale raise)."""

    def __init__(self, cfg):
        self.cur_scale = 2.0**cfg.initial_scale_power
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.window, self.min_scale = cfg.loss_scale_window, cfg.min_loss_scale
        self.delayed_shift = self.cur_hysteresis = cfg.hysteresis
        self.consecutive = cfg.consecutive_hysteresis

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2
        self.cur_iter += 1
        return self.cur_scale, self.cur_iter - 1 - self.last_overflow_iter, self.cur_hysteresis


def test_init_loss_scale():
    state = init_loss_scale(_fp16_cfg(initial_scale_power=16, hysteresis=2))
    assert isinstance(state, LossScaleState)
    assert float(state.scale) == 2.0**16 and state.scale.dtype == jnp.float32
    assert int(state.good_steps) == 0 and int(state.hysteresis) == 2


def test_hysteresis_delays_the_halving():
    # First overflow only uses up hysteresis; the second halves the scale.
    assert _run(_fp16_cfg(), [False, False]) == [(16.0, 0, 1), (8.0, 0, 1)]


def test_hysteresis_one_halves_at_once():
    assert _run(_fp16_cfg(hysteresis=1), [False, False]) == [(8.0, 0, 1), (4.0, 0, 1)]


def test_min_loss_scale_floor():
    seq = _run(_fp16_cfg(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0), [False] * 3)
    assert [s for s, _, _ in seq] == [2.0, 2.0, 2.0]


def test_growth_after_window_good_steps():
    seq = _run(_fp16_cfg(loss_scale_window=3), [True] * 7)
    assert [s for s, _, _ in seq] == [16, 16, 32, 32, 32, 64, 64]
    assert [n for _, n, _ in seq] == [1, 2, 3, 4, 5, 6, 7]


def test_growth_refills_hysteresis_only_after_full_window():
    # overflow (hyst 2→1), 2 good steps (still 1), 3rd good step grows and refills to 2.
    seq = _run(_fp16_cfg(loss_scale_window=3), [False, True, True, True])
    assert seq == [(16.0, 0, 1), (16.0, 1, 1), (16.0, 2, 1), (32.0, 3, 2)]


def test_consecutive_hysteresis_refills_after_any_good_step():
    seq = _run(_fp16_cfg(consecutive_hysteresis=True), [False, True, False, True])
    # Each good step resets hysteresis, so isolated overflows never halve the scale.
    assert seq == [(16.0, 0, 1), (16.0, 1, 2), (16.0, 0, 1), (16.0, 1, 2)]
    without = _run(_fp16_cfg(consecutive_hysteresis=False), [False, True, False, True])
    assert without[2][0] == 8.0


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_matches_deepspeed_on_a_random_sequence(consecutive, hysteresis):
    cfg = _fp16_cfg(
        hysteresis=hysteresis, consecutive_hysteresis=consecutive, loss_scale_window=4,
        initial_scale_power=6,
    )
    finite_seq = np.random.default_rng(hysteresis).random(60) > 0.3
    reference = _DeepSpeedScaler(cfg)
    expected = [reference.update(not f) for f in finite_seq]
    got = _run(cfg, finite_seq)
    assert got == [(float(s), int(n), int(h)) for s, n, h in expected]


def test_bad_hysteresis_rejected():
    with pytest.raises(ConfigError, match="fp16.hysteresis"):
        init_loss_scale(_fp16_cfg(hysteresis=0))


def test_scale_and_unscale_roundtrip():
    state = init_loss_scale(_fp16_cfg(initial_scale_power=16))
    loss = jnp.float16(3.0)
    scaled = jax.jit(scale_loss)(loss, state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 3.0 * 2**16
    grads = {"w": jnp.full((2,), 2.0**17, jnp.float32), "h": jnp.full((2,), 2.0**10, jnp.float16)}
    out = jax.jit(unscale_grads)(grads, state)
    assert out["h"].dtype == jnp.float16
    # Unscaling divides by a power of two: exact, whatever the order.
    chex.assert_trees_all_equal(
        out, {"w": jnp.full((2,), 2.0, jnp.float32), "h": jnp.full((2,), 2.0**-6, jnp.float16)}
    )


def test_select_tree_skips_step_on_overflow():
    old = {"p": jnp.zeros(3), "count": jnp.int32(5)}
    new = {"p": jnp.ones(3), "count": jnp.int32(6)}

    @jax.jit
    def step(grads):
        return select_tree(all_finite(grads), new, old)

    chex.assert_trees_all_equal(step({"g": jnp.ones(2)}), new)
    chex.assert_trees_all_equal(step({"g": jnp.array([1.0, jnp.nan])}), old)
