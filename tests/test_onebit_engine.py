"""1-bit Adam in the engine: Adam before the freeze, only compressed traffic after, exact resume."""

import functools

import chex
import jax
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.cost.hlo import collective_bytes
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
    """`steps` steps from `start`: the state and the losses, read once at the end (a read each
    step would wait for it: the convergence tests' steps took 1.6x as long)."""
    losses = []
    for step in range(start, start + steps):
        batch = dataset(data_seed).batch(step, global_batch=16)
        state, metrics = engine.train_step(state, batch)
        losses.append(metrics["loss"])
    return state, [float(loss) for loss in losses]


#: The convergence tests (this file's, tests/test_zero_one_adam.py's, tests/test_lamb.py's):
#: their seeds (each is the init key and the data seed), and the default run: steps, lr
#: warm-up, layers (one: a step then costs 0.8 of a two-layer one's, its optimizer's collectives
#: and the 8 workers' per-op overhead the same), how many of the last losses make the final loss.
CONVERGENCE_SEEDS = (0, 1, 2)
CONVERGENCE_STEPS, CONVERGENCE_WARMUP, CONVERGENCE_LAYERS, CONVERGENCE_TAIL = 120, 20, 1, 20
#: the bound on the mean over the seeds of 1-bit Adam's relative final-loss gap to Adam (see the
#: test's docstring)
CONVERGENCE_MEAN_GAP = 0.04
#: the convergence test's optimizers (`convergence_engine`'s arguments), frozen at a third
FREEZE = 40
ADAM = ("Adam", "lr: 0.003")
ONEBIT_ADAM = ("OneBitAdam", f"lr: 0.003, freeze_step: {FREEZE}")


@functools.cache
def convergence_engine(kind: str, params: str, *, steps: int = CONVERGENCE_STEPS,
                       warmup: int = CONVERGENCE_WARMUP, layers: int = CONVERGENCE_LAYERS):
    """The engine of a convergence run, once per process (a test may read its compiled steps):
    `optimizer.type=kind`, `optimizer.params={params}`, `layers` layers, the lr warmed up
    linearly over `warmup` steps, then cosine-decayed to 1e-4 of its peak at `steps`."""
    schedule = ("scheduler={type: WarmupCosine, params: {warmup_num_steps: %d, "
                "total_num_steps: %d, warmup_type: linear}}" % (warmup, steps))
    return js.initialize(config(f"optimizer.type={kind}", f"optimizer.params={{{params}}}",
                                schedule, f"model.n_layers={layers}"))


def convergence_gaps(baseline: tuple[str, str], rival: tuple[str, str], *,
                     steps: int = CONVERGENCE_STEPS, warmup: int = CONVERGENCE_WARMUP,
                     layers: int = CONVERGENCE_LAYERS,
                     seeds: tuple[int, ...] = CONVERGENCE_SEEDS) -> list[float]:
    """Per seed, `(rival - baseline) / baseline` of the final loss (the mean of the last
    `CONVERGENCE_TAIL` of `steps` steps); each is `(optimizer.type, params)` of a
    `convergence_engine`, trained on the same data and init."""
    engines = [convergence_engine(*optimizer, steps=steps, warmup=warmup, layers=layers)
               for optimizer in (baseline, rival)]
    gaps = []
    for seed in seeds:
        base, other = (
            np.mean(run(e, e.init(jax.random.key(seed)), 0, steps, data_seed=seed)[1]
                    [-CONVERGENCE_TAIL:])
            for e in engines)
        gaps.append((other - base) / base)
    return gaps


def test_before_the_freeze_it_is_adam():
    """8 warm-up steps (the lr ramping up to 0.00105) of the convergence test's engines, whose
    steps are compiled once for this file's tests."""
    adam, onebit = (convergence_engine(*optimizer) for optimizer in (ADAM, ONEBIT_ADAM))
    want, want_losses = run(adam, adam.init(jax.random.key(0)), 0, 8)
    got, losses = run(onebit, onebit.init(jax.random.key(0)), 0, 8)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    # Two different programs (shard_map step vs jit step) round differently: one element of
    # 2048 differed by 1.08e-6 after 4 steps at lr 0.01 (a larger sum of lrs than here).
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-6, atol=2e-6)


def test_after_the_freeze_only_compressed_bytes_move():
    engine = convergence_engine(*ONEBIT_ADAM)
    grad_bytes = 4 * count_params(engine.abstract_state().params)
    warmup = engine.profile()["collective_bytes"]
    compressed = collective_bytes(
        engine.compile_train_step(step=FREEZE).as_text(), num_devices=8
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


def test_a_returned_state_is_not_read_back_for_its_phase(monkeypatch):
    """The phase of the state the last step returned comes from the host's count: one read
    (the first state's) in 42 steps across the freeze, and one more for a state from
    elsewhere."""
    engine = convergence_engine(*ONEBIT_ADAM)
    state, reads, device_get = engine.init(jax.random.key(0)), [], jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or device_get(x))
    state, losses = run(engine, state, 0, FREEZE + 2)
    assert len(reads) == 1
    run(engine, jax.tree.map(lambda x: x.copy(), state), FREEZE + 2, 1)
    assert len(reads) == 2 and np.all(np.isfinite(losses))


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


@pytest.mark.slow
def test_converges_like_adam():
    """120 steps, freeze at a third: over 3 seeds, the final loss is on average within 4% of
    Adam's.

    The final loss is the mean of the last 20 steps' losses, Adam and 1-bit Adam see the same
    data, init and lr schedule for a seed (peak 0.003, linear warm-up over 20 steps, cosine
    decay to 1e-4 of the peak at step 120), and the gap is `(onebit - adam) / adam`. The model
    has one layer.

    Why a decaying lr: at a constant lr the last 20 losses sample a noisy trajectory that the
    float sum order (another CPU, jaxlib or XLA optimisation level) changes. One seed's gap
    went from +3% to +18% between CPUs: on a 2-core AVX2 EPYC, 1-bit Adam's loss spiked at step
    288 of a 300-step run (1-bit Adam with an exact all-reduce instead of the compressed one:
    +5.6%). With the lr decayed to nearly 0 the run settles.

    Why a freeze at a third: in a run this short a freeze at a fifth (step 30 of 150) froze
    the variance of too few steps: correct seeds 3, 4, 5 averaged +4.8%.

    Measured on the AVX2 EPYC (jax 0.12; -O0, the suite's level, and XLA's default level):
    - correct, seeds 0-7 at -O0: per seed +1.7% to +3.5%, and no three consecutive seeds
      average more than +3.1%; the mean over seeds 0, 1, 2 is +2.2% at both levels.
    - broken, without server error feedback, seeds 0-3: per seed +4.2% to +7.9%, and every
      three consecutive seeds average +5.5% or more (seeds 0, 1, 2: +5.8%).

    4% lies between the two. (The 300-step two-layer run this replaced, 2.5 times the steps:
    correct +1.6%, broken +6.3% over seeds 0, 1, 2, and the same 4%.) The issue's "within 3%"
    for one seed is not a property a single seed can show: in that run one correct seed reached
    +4.4% while one broken seed stayed at +4.9%.
    """
    gaps = convergence_gaps(ADAM, ONEBIT_ADAM)
    per_seed = dict(zip(CONVERGENCE_SEEDS, np.round(gaps, 4).tolist()))
    assert abs(np.mean(gaps)) <= CONVERGENCE_MEAN_GAP, per_seed


def test_each_worker_draws_its_own_randomness(monkeypatch):
    """Gate noise and dropout differ between workers: each folds its index into the key."""
    from jaxspeed.train import onebit_step

    real = onebit_step._loss_and_grads

    def spy(spec, params, micro, rng, scale):  # reports the key each worker sees
        loss, extras, grads, fp8_meta = real(spec, params, micro, rng, scale)
        k = (jax.random.key_data(rng)[-1] % 1000).astype(np.float32)
        return loss, {**extras, "k": k, "k2": k * k}, grads, fp8_meta

    monkeypatch.setattr(onebit_step, "_loss_and_grads", spy)
    engine = js.initialize(config(*ONEBIT))
    _, metrics = engine.train_step(engine.init(jax.random.key(0)), dataset().batch(0, global_batch=16))
    mean, mean_square = float(metrics["k"]), float(metrics["k2"])  # over the 8 workers
    assert mean_square - mean**2 > 1.0  # the keys vary (equal keys: exactly 0)
