"""Training the reference GPT with block-sparse attention (`configs/gpt_sparse.yaml`)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.attention import FixedSparsityConfig
from jaxspeed.data import TokenDataset
from jaxspeed.models import build_gpt
from numerics import assert_adam_params_close, gpt_rtol, sum_rtol

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "gpt_sparse.yaml"
# The config's model, shrunk (`--set`-style overrides) so a step compiles in seconds; the
# sequence length, layout and mesh (8 devices, data-parallel) stay the config's.
SMALL = [
    "model.d_model=32", "model.n_layers=1", "model.d_ff=64",
    "data.max_bytes=200000", "logging.eval_every_n_steps=0",
]
SHORT = ["data.seq_len=128", "model.max_seq_len=128"]


def _config(*overrides):
    return js.load_config(CONFIG, overrides=[*SMALL, *overrides])


def _copy(state):
    return jax.tree.map(jnp.copy, state)  # train steps donate their state


@pytest.fixture(scope="module")
def initial_state():
    """The small model's initial train state (attention adds no parameters: shared by all)."""
    engine = js.initialize(_config(*SHORT, "model.sparse_attention=null"))
    return engine.init(jax.random.key(0))


def _train(config, state, steps):
    """Runs `steps` train steps from a copy of `state`.

    Returns:
      `(losses [steps], grad_norms [steps], final state)`.
    """
    engine = js.initialize(config)
    dataset = TokenDataset.from_config(config.data, seed=config.seed)
    state, losses, grad_norms = _copy(state), [], []
    for step in range(steps):
        batch = dataset.batch(step, global_batch=engine.batch_sizes.train_batch_size)
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(grad_norms), state


def test_config_is_a_causal_fixed_layout_at_seq_1024():
    config = js.load_config(CONFIG)
    assert config.data.seq_len == config.model.max_seq_len == 1024
    sparsity = build_gpt(config.model).sparse_attention
    assert isinstance(sparsity, FixedSparsityConfig)
    assert sparsity.attention == "unidirectional"
    layout = sparsity.make_layout(1024).astype(bool)
    assert not np.triu(layout, k=1).any()  # no block above the diagonal: causal
    assert 0.10 <= layout.mean() <= 0.20, layout.mean()


def test_gpt_sparse_yaml_lowers_the_loss(initial_state):
    """The config's Fixed layout at seq 1024 on 8 devices; constant lr so 5 steps suffice."""
    config = _config(
        "scheduler.type=constant", "scheduler.params={}", "optimizer.params.lr=1e-2",
        "model.sparse_attention.impl=xla",
    )
    assert config.data.seq_len == 1024 and config.model.sparse_attention.mode == "fixed"
    losses, _, _ = _train(config, initial_state, steps=5)
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < losses[0] - 0.2, losses  # ~5.5 (uniform over bytes) falls


@pytest.mark.slow  # two more train-step compiles: ~20 s of CPU on top of the fixture's
def test_dense_layout_trains_exactly_like_the_dense_model(initial_state):
    """All blocks kept (through the XLA gather path) = the dense causal model, step by step."""
    constant_lr = ["scheduler.type=constant", "scheduler.params={}", "optimizer.params.lr=3e-3"]
    dense_layout = "model.sparse_attention={mode: dense, block: 32, impl: xla}"
    sparse = _train(_config(*SHORT, *constant_lr, dense_layout), initial_state, steps=3)
    dense = _train(
        _config(*SHORT, *constant_lr, "model.sparse_attention=null"), initial_state, steps=3
    )
    # Another attention program (tests/numerics.py): the small GPT on 8 x 128 tokens a step.
    rho = gpt_rtol(tokens=8 * 128, d_model=32, d_ff=64, n_layers=1, vocab=256)
    np.testing.assert_allclose(sparse[0], dense[0], rtol=rho)  # losses
    # The gradient norm sums the squares of every parameter's gradient: one more reduction.
    n_params = sum(x.size for x in jax.tree.leaves(dense[2].params))
    np.testing.assert_allclose(sparse[1], dense[1], rtol=rho + sum_rtol(n_params))
    assert_adam_params_close(sparse[2].params, dense[2].params, steps=3, lr=3e-3, rho=rho)
    assert int(sparse[2].step) == 3
    assert sparse[0][-1] < sparse[0][0]  # the parameters moved


@pytest.mark.slow  # a subprocess compiling two small models: ~30-80 s on 2 busy cores
def test_long_context_example_runs_reduced():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "examples/long_context_sparse.py", "--seq-len", "256", "--steps", "1",
         "--d-model", "32", "--n-layers", "1", "--d-ff", "64", "--block", "32",
         "--set", "data.max_bytes=200000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    assert "step time (median)" in result.stdout and "temp bytes per device" in result.stdout
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["seq_len"] == 256 and 0 < summary["density"] < 1
    for mode in ("sparse", "dense"):
        assert len(summary[mode]["losses"]) == 2
        assert all(math.isfinite(x) and 0 < x < 10 for x in summary[mode]["losses"])
        assert summary[mode]["step_s"] > 0
    # Fewer blocks, less scratch: the sparse step's temporaries are smaller than the dense one's.
    assert summary["sparse"]["temp_bytes"] < summary["dense"]["temp_bytes"], summary
