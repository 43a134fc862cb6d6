"""1-bit Adam in the engine: Adam before the freeze, only compressed traffic after, exact resume."""

import functools

import chex
import jax
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.models.gpt import count_params

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=16",
    "gradient_clipping=0", "mesh.data=8",
]
ONEBIT = ["optimizer.type=OneBitAdam"]


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@functools.cache
def dataset(seed=0):
    return TokenDataset.from_config(config().data, seed=seed)


def run(engine, state, start, steps, *, data_seed=0):
    losses = []
    for step in range(start, start + steps):
        batch = dataset(data_seed).batch(step, global_batch=16)
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_before_the_freeze_it_is_adam():
    adam = js.initialize(config("optimizer.type=Adam", "optimizer.params={lr: 0.01}"))
    want, want_losses = run(adam, adam.init(jax.random.key(0)), 0, 4)
    onebit = js.initialize(config(*ONEBIT, "optimizer.params={lr: 0.01, freeze_step: 100}"))
    got, losses = run(onebit, onebit.init(jax.random.key(0)), 0, 4)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    # Two different programs (shard_map step vs jit step) round differently: one element of
    # 2048 differed by 1.08e-6 after 4 steps at lr 0.01.
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-6, atol=2e-6)


def test_after_the_freeze_only_compressed_bytes_move():
    engine = js.initialize(config(*ONEBIT, "optimizer.params={lr: 0.01, freeze_step: 2}"))
    grad_bytes = 4 * count_params(engine.abstract_state().params)
    warmup = engine.profile()["collective_bytes"]
    compressed = js.profiler.collective_bytes(
        engine.compile_train_step(step=2).as_text(), num_devices=8
    )
    assert grad_bytes <= warmup["all-reduce"] <= grad_bytes + 64
    assert compressed["all-reduce"] <= 16  # the loss and grad-norm scalars
    assert compressed["all-to-all"] > 0 and compressed["all-gather"] > 0
    assert compressed["total"] < warmup["total"] / 8


def test_resume_mid_compression_is_bit_exact(tmp_path):
    cfg = config(*ONEBIT, "optimizer.params={lr: 0.001, freeze_step: 3}", "bf16.enabled=true")
    engine = js.initialize(cfg)
    straight, straight_losses = run(engine, engine.init(jax.random.key(0)), 0, 6)
    half, losses = run(engine, engine.init(jax.random.key(0)), 0, 4)
    engine.save(half, directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    resumed, more = run(engine, engine.restore(directory=tmp_path), 4, 2)
    assert losses + more == straight_losses
    chex.assert_trees_all_equal(resumed.params, straight.params)
    chex.assert_trees_all_equal(resumed.opt_state, straight.opt_state)


def test_tensor_parallel_inside_a_data_shard():
    mesh = ["mesh.data=4", "mesh.tensor=2"]
    adam = js.initialize(config("optimizer.type=Adam", "optimizer.params={lr: 0.001}", *mesh))
    _, want = run(adam, adam.init(jax.random.key(0)), 0, 3)
    onebit = js.initialize(config(*ONEBIT, "optimizer.params={lr: 0.001, freeze_step: 3}", *mesh))
    state, losses = run(onebit, onebit.init(jax.random.key(0)), 0, 3)
    np.testing.assert_allclose(losses, want, rtol=1e-5)  # warm-up: Adam on averaged local grads
    _, compressed = run(onebit, state, 3, 3)
    assert np.all(np.isfinite(compressed))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["zero_optimization.stage=2"], "stage=2"),
        (["fp16.enabled=true"], "fp16"),
        (["optimizer.params={freeze_step: -1}"], "freeze_step must be >= 0"),
    ],
)
def test_what_it_does_not_combine_with_is_a_clear_error(overrides, match):
    with pytest.raises(ConfigError, match=match):
        js.initialize(config(*ONEBIT, *overrides))


#: Seeds of the convergence test (each is the init key and the data seed), and the bound on the
#: mean over them of 1-bit Adam's relative final-loss gap to Adam (see the test's docstring).
CONVERGENCE_SEEDS = (0, 1, 2)
CONVERGENCE_MEAN_GAP = 0.05


@pytest.mark.slow
def test_converges_like_adam():
    """300 steps, freeze at 20%: over 3 seeds, the final loss is on average within 5% of Adam's.

    The final loss is the mean of the last 20 steps' losses, Adam and 1-bit Adam see the same
    data and init for a seed, and the gap is `(onebit - adam) / adam`. One seed's gap is not a
    property of 1-bit Adam: it moves by several percent with the float sum order (another
    jaxlib, XLA optimisation level or CPU). Measured (jax 0.12 at -O0 and at XLA's default
    level, jax 0.11.2 at both; `--xla_cpu_max_isa=AVX2` changed no result):

    - correct, 25 seeds on jax 0.12 at -O0: median +1.7%, range -0.9% to +7.0% (10 seeds at
      the default level: median +1.4%, up to +6.2%). Over the four configurations seed 0 gave
      -0.05% to +0.4% (+3.1% on jax 0.10.2 on an AVX-512 CPU), seed 1 -0.2% to +0.3%, seed 2
      +3.3% to +7.6% (there 1-bit Adam trails Adam from the freeze on).
    - the mean over seeds 0, 1, 2: +1.2% to +2.5% in the four configurations.
    - broken: without server error feedback the mean is +6.6% (-O0) and +6.9% (default);
      without any error feedback +92% and +187%; a step that stops at the freeze +20.5%.

    5% is twice the largest correct mean and below the subtlest broken variant. A single seed
    would need a bound near 15% (twice its worst case), loose enough to pass the missing server
    error feedback.
    """
    engines = {
        name: js.initialize(config(f"optimizer.type={name}", f"optimizer.params={{{params}}}"))
        for name, params in (("Adam", "lr: 0.003"), ("OneBitAdam", "lr: 0.003, freeze_step: 60"))
    }
    gaps = []
    for seed in CONVERGENCE_SEEDS:
        final = {}
        for name, engine in engines.items():
            _, losses = run(engine, engine.init(jax.random.key(seed)), 0, 300, data_seed=seed)
            final[name] = np.mean(losses[-20:])
        gaps.append((final["OneBitAdam"] - final["Adam"]) / final["Adam"])
    per_seed = dict(zip(CONVERGENCE_SEEDS, np.round(gaps, 4).tolist()))
    assert abs(np.mean(gaps)) <= CONVERGENCE_MEAN_GAP, per_seed


def test_each_worker_draws_its_own_randomness(monkeypatch):
    """Gate noise and dropout differ between workers: each folds its index into the key."""
    from jaxspeed import onebit_step

    real = onebit_step._loss_and_grads

    def spy(spec, params, micro, rng, scale):  # reports the key each worker sees
        loss, extras, grads = real(spec, params, micro, rng, scale)
        k = (jax.random.key_data(rng)[-1] % 1000).astype(np.float32)
        return loss, {**extras, "k": k, "k2": k * k}, grads

    monkeypatch.setattr(onebit_step, "_loss_and_grads", spy)
    engine = js.initialize(config(*ONEBIT))
    _, metrics = engine.train_step(engine.init(jax.random.key(0)), dataset().batch(0, global_batch=16))
    mean, mean_square = float(metrics["k"]), float(metrics["k2"])  # over the 8 workers
    assert mean_square - mean**2 > 1.0  # the keys vary (equal keys: exactly 0)
