"""Tests for jaxspeed.optim.factory: optimizers, schedules and clipping from config."""

import math
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspeed.config import load_config
from jaxspeed.errors import ConfigError
from jaxspeed.optim import build_optimizer, make_optimizer, make_schedule
from jaxspeed.optim.factory import base_learning_rate, onebit_phases
from numerics import adam_constants_rtol, assert_close, program_rtol


def _opt(type_, **params):
    return SimpleNamespace(type=type_, params=params)


def _sched(type_, **params):
    return SimpleNamespace(type=type_, params=params)


def _params():
    return {
        "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 10 - 0.5,
        "b": jnp.array([0.3, -0.2, 0.1], jnp.float32),
    }


def _grads():
    return {
        "w": jnp.cos(jnp.arange(12, dtype=jnp.float32)).reshape(3, 4),
        "b": jnp.array([1.0, -2.0, 0.5], jnp.float32),
    }


def _one_update(tx, steps=2):
    """Runs `steps` jitted updates with the same gradients; returns the final updates."""
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(steps):
        updates, state = update(_grads(), state, params)
        params = optax.apply_updates(params, updates)
    return params


LR = 0.05


@pytest.mark.parametrize(
    "cfg, reference",
    [
        (_opt("Adam", lr=LR), optax.adam(LR)),
        (
            _opt("Adam", lr=LR, betas=[0.8, 0.99], eps=1e-6, weight_decay=0.1),
            optax.adamw(LR, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),
        ),
        (_opt("AdamW", lr=LR, weight_decay=0.1), optax.adamw(LR, weight_decay=0.1)),
        (_opt("AdamW", lr=LR), optax.adamw(LR, weight_decay=0.0)),
        (_opt("SGD", lr=LR), optax.sgd(LR)),
        (
            _opt("SGD", lr=LR, momentum=0.9, nesterov=True),
            optax.sgd(LR, momentum=0.9, nesterov=True),
        ),
        (
            _opt("SGD", lr=LR, momentum=0.9, weight_decay=0.1),
            optax.chain(optax.add_decayed_weights(0.1), optax.sgd(LR, momentum=0.9)),
        ),
        (_opt("Lion", lr=LR), optax.lion(LR, weight_decay=0.0)),
        (
            _opt("Lion", lr=LR, betas=[0.95, 0.98], weight_decay=0.1),
            optax.lion(LR, b1=0.95, b2=0.98, weight_decay=0.1),
        ),
        (_opt("Adafactor", lr=LR), optax.adafactor(LR)),
        (
            _opt("Adafactor", lr=LR, decay_rate=0.7, clipping_threshold=0.0, weight_decay=0.01),
            optax.adafactor(LR, decay_rate=0.7, clipping_threshold=None, weight_decay_rate=0.01),
        ),
        (_opt("adamw", lr=LR), optax.adamw(LR, weight_decay=0.0)),  # DeepSpeed lowercases
    ],
)
def test_optimizer_matches_optax_alias(cfg, reference):
    tx = make_optimizer(cfg, learning_rate=LR)
    # The factory builds the same optax transformations: the same program, bit for bit.
    chex.assert_trees_all_equal(_one_update(tx), _one_update(reference))


def test_adam_l2_mode_matches_plain_adam_with_l2():
    wd, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    tx = make_optimizer(_opt("Adam", lr=LR, weight_decay=wd, adam_w_mode=False), learning_rate=LR)
    params, grads = _params(), _grads()
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    # One step of Adam on g + wd * p: m_hat = g', v_hat = g'^2.
    expected = {}
    for k in params:
        g = np.asarray(grads[k], np.float64) + wd * np.asarray(params[k], np.float64)
        m_hat = (1 - b1) * g / (1 - b1)
        v_hat = (1 - b2) * g * g / (1 - b2)
        expected[k] = -LR * m_hat / (np.sqrt(v_hat) + eps)
    # fp32 against the exact value (tests/numerics.py): g + wd * p, the two moments, their bias
    # corrections, the square root, the division and the lr: a chain of 8 operations of at
    # most 2 terms each; and b1, b2 rounded to fp32, which the bias corrections magnify.
    rtol = program_rtol(width=2, depth=8) + adam_constants_rtol(b1=b1, b2=b2)
    assert_close(updates, expected, rtol=rtol)


def test_adam_decoupled_decay_differs_from_l2():
    kwargs = dict(lr=LR, weight_decay=0.1)
    decoupled = make_optimizer(_opt("Adam", **kwargs), learning_rate=LR)
    l2 = make_optimizer(_opt("Adam", adam_w_mode=False, **kwargs), learning_rate=LR)
    a, b = _one_update(decoupled), _one_update(l2)
    assert not np.allclose(a["w"], b["w"])


def test_optimizer_takes_a_schedule():
    schedule = optax.linear_schedule(0.0, 1.0, transition_steps=10)
    tx = make_optimizer(_opt("SGD", lr=1.0), learning_rate=schedule)
    params, grads = _params(), _grads()
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, grads))  # lr(0) = 0
    updates, _ = jax.jit(tx.update)(grads, state, params)
    # lr(1) = 0 + (1 - 0) * 1 / 10 in fp32, then -lr * g: 4 chained operations.
    want = jax.tree.map(lambda g: -0.1 * g, grads)
    assert_close(updates, want, rtol=program_rtol(width=2, depth=4))


def _full_config(clip, scheduler=None):
    return SimpleNamespace(
        optimizer=_opt("SGD", lr=1.0), scheduler=scheduler, gradient_clipping=clip
    )


def _global_norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree))))


@pytest.mark.parametrize("clip", [0.0, 0.5, 100.0])
def test_build_optimizer_clips_iff_gradient_clipping_positive(clip):
    tx, schedule = build_optimizer(_full_config(clip))
    params, grads = _params(), _grads()
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    norm = _global_norm(grads)
    factor = min(1.0, clip / norm) if clip > 0 else 1.0
    # fp32 against the exact value (tests/numerics.py): the global norm sums 15 squares, then
    # its square root, the division and the product; the norm of the result is one more sum.
    rtol = program_rtol(width=15, depth=4)
    assert_close(updates, jax.tree.map(lambda g: -factor * g, grads), rtol=rtol)
    if 0 < clip < norm:
        assert _global_norm(updates) == pytest.approx(clip, rel=program_rtol(width=15, depth=5))
    assert float(schedule(0)) == 1.0
    sgd = optax.sgd(optax.constant_schedule(1.0))  # the lr is a schedule
    expected_tx = optax.chain(optax.clip_by_global_norm(clip), sgd) if clip > 0 else sgd
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(expected_tx.init(params))


def test_build_optimizer_returns_the_schedule_it_uses():
    sched = _sched("WarmupLR", warmup_num_steps=4, warmup_type="linear")
    config = SimpleNamespace(optimizer=_opt("SGD", lr=0.4), scheduler=sched, gradient_clipping=0)
    tx, schedule = build_optimizer(config)
    params, grads = _params(), _grads()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(6):
        updates, state = update(grads, state, params)
        # The optimizer reads this schedule, but jitted into its update, where XLA may fuse
        # (reorder) its 4 operations and the product with g differently from the eager call.
        want = jax.tree.map(lambda g: -schedule(step) * g, grads)
        assert_close(updates, want, rtol=program_rtol(width=2, depth=5))
    assert float(schedule(5)) == pytest.approx(0.4, rel=program_rtol(width=2, depth=4))


def test_typed_config_builds_the_same_optimizer():
    typed = load_config(
        {"optimizer": {"type": "adam", "params": {"lr": LR, "weight_decay": 0.1}}}
    ).optimizer
    untyped = _opt("Adam", lr=LR, weight_decay=0.1)
    chex.assert_trees_all_equal(
        _one_update(make_optimizer(typed, learning_rate=LR)),
        _one_update(make_optimizer(untyped, learning_rate=LR)),
    )


def test_build_optimizer_reports_every_error_at_once():
    config = SimpleNamespace(
        optimizer=_opt("SGD", lr="fast"), scheduler=_sched("WarmupDecayLR"), gradient_clipping=-1.0
    )
    with pytest.raises(ConfigError) as info:
        build_optimizer(config)
    message = str(info.value)
    assert "optimizer.params.lr: Input should be a valid number (got 'fast')" in message
    assert "scheduler.params.total_num_steps is required for scheduler.type WarmupDecayLR" in (
        message
    )
    assert "gradient_clipping: Input should be greater than or equal to 0 (got -1.0)" in message


def test_base_learning_rate_default_and_value():
    assert base_learning_rate(_opt("Adam")) == 1e-3
    assert base_learning_rate(_opt("Adam", lr=3e-4)) == 3e-4


# ------------------------------------------------------------------------------ schedules
# DeepSpeed's formulas, written plainly (deepspeed/runtime/lr_schedules.py).


def _ds_gamma(step, warmup_steps, warmup_type):
    w = max(2, warmup_steps)
    if warmup_type == "log":
        return math.log(step + 1) / math.log(w)
    return step / w


def _ds_warmup_lr(step, min_lr, max_lr, warmup_steps, warmup_type):
    w = max(2, warmup_steps)
    gamma = _ds_gamma(step, w, warmup_type) if step < w else 1.0
    return min_lr + (max_lr - min_lr) * gamma


def _ds_warmup_decay_lr(step, min_lr, max_lr, warmup_steps, total, warmup_type):
    w = max(2, warmup_steps)
    if step < w:
        gamma = _ds_gamma(step, w, warmup_type)
    else:
        gamma = max(0.0, (total - step) / max(1.0, total - w))
    return min_lr + (max_lr - min_lr) * gamma


def _ds_warmup_cosine(step, base_lr, total, wmin, warmup_steps, cmin, warmup_type):
    w = max(2, warmup_steps)
    if step < w:
        ratio = wmin + _ds_gamma(step, w, warmup_type) * (1 - wmin)
    else:
        progress = min(1.0, (step - w + 1) / max(1, total - w))
        ratio = max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)
    return base_lr * ratio


STEPS = [0, 1, 2, 5, 9, 10, 11, 17, 30, 49, 50, 51, 80]
#: A schedule in fp32 against DeepSpeed's formula in float64 (tests/numerics.py): a chain of
#: at most 6 operations (the step's float, a log or a cosine, a division, a product, a 2-term
#: sum, the join's select), relative to the schedule's largest value.
SCHEDULE_RTOL = program_rtol(width=2, depth=6)


def _check_schedule(schedule, reference):
    jitted = jax.jit(schedule)
    got = np.array([float(jitted(jnp.int32(s))) for s in STEPS])
    eager = np.array([float(schedule(s)) for s in STEPS])
    want = np.array([reference(s) for s in STEPS])
    assert_close(got, want, rtol=SCHEDULE_RTOL)
    assert_close(eager, want, rtol=SCHEDULE_RTOL)


def test_constant_schedule():
    _check_schedule(make_schedule(_sched("constant"), base_lr=0.3), lambda s: 0.3)
    _check_schedule(make_schedule(None, base_lr=0.3), lambda s: 0.3)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr(warmup_type):
    cfg = _sched(
        "WarmupLR", warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=10,
        warmup_type=warmup_type,
    )
    ref = lambda s: _ds_warmup_lr(s, 0.01, 0.2, 10, warmup_type)  # noqa: E731
    _check_schedule(make_schedule(cfg, base_lr=0.5), ref)


def test_warmup_lr_defaults_to_optimizer_lr_and_log():
    ref = lambda s: _ds_warmup_lr(s, 0.0, 0.5, 1000, "log")  # noqa: E731
    _check_schedule(make_schedule(_sched("WarmupLR"), base_lr=0.5), ref)


def test_warmup_num_steps_clamped_to_two():
    cfg = _sched("WarmupLR", warmup_num_steps=1, warmup_max_lr=1.0)
    _check_schedule(make_schedule(cfg, base_lr=1.0), lambda s: _ds_warmup_lr(s, 0, 1, 1, "log"))


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("total", [50, 10, 5])
def test_warmup_decay_lr(warmup_type, total):
    cfg = _sched(
        "WarmupDecayLR", warmup_min_lr=0.01, warmup_num_steps=10, total_num_steps=total,
        warmup_type=warmup_type,
    )
    ref = lambda s: _ds_warmup_decay_lr(s, 0.01, 0.5, 10, total, warmup_type)  # noqa: E731
    _check_schedule(make_schedule(cfg, base_lr=0.5), ref)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("total", [50, 10])
def test_warmup_cosine(warmup_type, total):
    cfg = _sched(
        "WarmupCosine", total_num_steps=total, warmup_min_ratio=0.1, warmup_num_steps=10,
        cos_min_ratio=0.05, warmup_type=warmup_type,
    )
    ref = lambda s: _ds_warmup_cosine(s, 0.5, total, 0.1, 10, 0.05, warmup_type)  # noqa: E731
    _check_schedule(make_schedule(cfg, base_lr=0.5), ref)


def test_warmup_cosine_defaults():
    cfg = _sched("WarmupCosine", total_num_steps=3000)
    ref = lambda s: _ds_warmup_cosine(s, 0.5, 3000, 0.0, 1000, 1e-4, "log")  # noqa: E731
    _check_schedule(make_schedule(cfg, base_lr=0.5), ref)


# --------------------------------------------------------------------------------- errors


def test_unknown_optimizer_param_suggests_key():
    with pytest.raises(ConfigError, match=r"optimizer\.params\.beta: unknown key.*'betas'"):
        make_optimizer(_opt("AdamW", beta=[0.9, 0.99]), learning_rate=LR)


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ConfigError, match="gradient_clipping"):
        make_optimizer(_opt("Adam", max_grad_norm=1.0), learning_rate=LR)


@pytest.mark.parametrize(
    "params, key",
    [({"betas": 0.9}, "betas"), ({"eps": "1e-8"}, "eps"), ({"adam_w_mode": 1}, "adam_w_mode"),
     ({"lr": True}, "lr")],
)
def test_wrong_optimizer_value_type(params, key):
    with pytest.raises(ConfigError, match=rf"optimizer\.params\.{key}"):
        make_optimizer(_opt("Adam", **params), learning_rate=LR)


def test_onebit_adam_from_config():
    tx = make_optimizer(_opt("OneBitAdam", lr=LR, freeze_step=10), learning_rate=LR)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    assert type(state).__name__ == "OneBitAdamState"
    with pytest.raises(ConfigError, match="freeze_step must be >= 0"):
        make_optimizer(_opt("OneBitAdam", lr=LR, freeze_step=-1), learning_rate=LR)
    with pytest.raises(ConfigError, match="freeze_stepp"):
        make_optimizer(_opt("OneBitAdam", lr=LR, freeze_stepp=3), learning_rate=LR)


def test_onebit_phases():
    phases, phase_of = onebit_phases(_opt("OneBitAdam"))
    assert phases == ("warmup", "compressed") and phase_of(99_999) == "warmup"
    _, phase_of = onebit_phases(_opt("onebitadam", freeze_step=1e3))
    assert (phase_of(999), phase_of(1000)) == ("warmup", "compressed")
    phases, phase_of = onebit_phases(_opt("ZeroOneAdam", var_freeze_step=2,
                                          local_step_scaler=1, local_step_clipper=2))
    assert phases == ("variance", "gradient", "local", "sync")
    assert [phase_of(c) for c in range(6)] == ["variance", "variance", "sync", "sync", "local", "sync"]
    with pytest.raises(ConfigError, match="optimizer.type Adam has no 1-bit phases"):
        onebit_phases(_opt("Adam"))


def test_unknown_optimizer_type_lists_accepted():
    with pytest.raises(ConfigError, match=r"accepted: Adam, AdamW.*did you mean 'Lion'"):
        make_optimizer(_opt("Lian"), learning_rate=LR)


def test_unknown_scheduler_param_suggests_key():
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_steps.*'warmup_num_steps'"):
        make_schedule(_sched("WarmupLR", warmup_steps=10), base_lr=0.1)


def test_scheduler_missing_total_num_steps():
    with pytest.raises(ConfigError, match=r"scheduler\.params\.total_num_steps is required"):
        make_schedule(_sched("WarmupCosine"), base_lr=0.1)


@pytest.mark.parametrize(
    "params, match",
    [({"warmup_type": "cosine"}, "warmup_type"), ({"warmup_num_steps": 0}, "warmup_num_steps"),
     ({"warmup_num_steps": 2.5}, "warmup_num_steps")],
)
def test_bad_scheduler_values(params, match):
    with pytest.raises(ConfigError, match=match):
        make_schedule(_sched("WarmupLR", **params), base_lr=0.1)


def test_unknown_scheduler_type():
    with pytest.raises(ConfigError, match=r"scheduler\.type.*accepted"):
        make_schedule(_sched("OneCycle"), base_lr=0.1)


def test_build_optimizer_keeps_a_loose_configs_moe_bias_balance():
    """`model.moe.balance: bias` moves the selection biases by their own rule; a loose config
    lost its `model` on the way and trained them with the optimizer (issue 60)."""
    moe = {"num_experts": 4, "k": 2, "balance": "bias", "bias_update_rate": 0.01}
    plain = _full_config(0.0)
    balanced = SimpleNamespace(**vars(plain), model={"moe": moe})
    params = {"w": jnp.ones((2, 2))}
    tx_plain, tx_balanced = build_optimizer(plain)[0], build_optimizer(balanced)[0]
    assert type(tx_balanced.init(params)) is not type(tx_plain.init(params))  # optax.partition's
    typed = load_config({"model": {"moe": moe}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    assert jax.tree.structure(build_optimizer(typed)[0].init(params)) == jax.tree.structure(
        tx_balanced.init(params))
