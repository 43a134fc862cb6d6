"""QK-clip (MuonClip): the attention logit maxima against float64, the clip against its formula,
and the engine on 8 devices clipping exactly the heads past the threshold."""

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.models import build_gpt
from jaxspeed.models.dense_attention import max_logits
from jaxspeed.ops.losses import LOGIT_MAX, logit_maxima, mean_extras, sum_extras, zero_extras
from jaxspeed.optim.qk_clip import qk_clip
from numerics import UNIT_ROUNDOFF, assert_close, gpt_rtol, program_rtol
from test_muon import TINY


def reference_max_logits(q, k, order, segments, window):
    """Each head's largest `q·k/√d` over the keys each query sees, in float64 loops."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    best = np.full(q.shape[2], -np.inf)
    for b, i, j in itertools.product(*map(range, (q.shape[0], q.shape[1], k.shape[1]))):
        seen = order[j] <= order[i] and segments[b, i] == segments[b, j]
        if seen and (window is None or order[j] > order[i] - window):
            logits = np.einsum("hd,hd->h", q[b, i], k[b, j]) / math.sqrt(q.shape[-1])
            best = np.maximum(best, logits)
    return best


@pytest.mark.parametrize("block,window,permuted", [(12, None, False), (4, None, True),
                                                   (4, 3, False)])
def test_max_logits_match_float64(block, window, permuted):
    q, k = (jax.random.normal(jax.random.key(i), (2, 12, 4, 8)) for i in (0, 1))
    order = np.random.default_rng(0).permutation(12) if permuted else np.arange(12)
    segments = np.repeat([[0] * 5 + [1] * 7], 2, axis=0)
    got = max_logits(q, k, jnp.asarray(order) if permuted else None, jnp.asarray(segments),
                     window=window, block=block)
    want = reference_max_logits(q, k, order, segments, window)
    np.testing.assert_allclose(got, want, rtol=program_rtol(width=8, depth=1), atol=0)


def test_microbatch_extras_sum_and_max():
    """The step's extras over microbatches: summed then averaged, the maxima maxed, negative
    ones included (the accumulator starts at -inf)."""
    shapes = {"aux_loss": jnp.zeros(()), LOGIT_MAX: {"layers/attn": jnp.zeros((2,))}}
    micro = [{"aux_loss": jnp.float32(a), LOGIT_MAX: {"layers/attn": jnp.asarray(m)}}
             for a, m in ((1.0, [-3.0, 2.0]), (2.0, [-5.0, 1.0]))]
    total = zero_extras(shapes)
    for extras in micro:
        total = sum_extras(total, extras)
    got = mean_extras(total, 2)
    assert float(got["aux_loss"]) == 1.5
    np.testing.assert_array_equal(got[LOGIT_MAX]["layers/attn"], [-3.0, 2.0])


THRESHOLD = 1.0
# two layers' attention: 4 query heads over 2 key heads, with biases
PARAMS = {"layers": {"attn": {
    "query": (2, 16, 4, 8), "key": (2, 16, 2, 8), "value": (2, 16, 2, 8),
    "query_bias": (2, 4, 8), "key_bias": (2, 2, 8)}}}
MAXIMA = np.array([[0.5, 4.0, 1.0, 2.0], [3.0, 0.9, 0.2, 0.1]], np.float32)


def _tree(seed):
    shapes = jax.tree.leaves(PARAMS, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    leaves = [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]
    return jax.tree.unflatten(jax.tree.structure(PARAMS, is_leaf=lambda x: isinstance(x, tuple)),
                              leaves)


@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_clip_scales_the_updated_projections_of_heads_past_the_threshold(alpha):
    params, updates = _tree(0), _tree(1)
    tx = qk_clip(THRESHOLD, alpha)
    got, _ = tx.update(updates, tx.init(params), params,
                       attn_logit_max={"layers/attn": jnp.asarray(MAXIMA)})
    gamma = np.minimum(1.0, THRESHOLD / MAXIMA)  # [layers, heads]
    query, key = gamma**alpha, (gamma**(1 - alpha)).reshape(2, 2, 2).min(-1)
    new = jax.tree.map(lambda p, u: np.asarray(p + u, np.float64), params, updates)
    want = {"query": new["layers"]["attn"]["query"] * query[:, None, :, None],
            "key": new["layers"]["attn"]["key"] * key[:, None, :, None],
            "query_bias": new["layers"]["attn"]["query_bias"] * query[:, :, None],
            "key_bias": new["layers"]["attn"]["key_bias"] * key[:, :, None],
            "value": new["layers"]["attn"]["value"]}
    landed = jax.tree.map(lambda p, u: p + u, params, got)["layers"]["attn"]
    rtol = 4 * UNIT_ROUNDOFF["float32"]  # the scale, the product, and p + (p' - p)
    for name, value in want.items():
        np.testing.assert_allclose(landed[name], value, rtol=rtol, atol=rtol, err_msg=name)
    # heads at or under the threshold (and the values) keep their update bit for bit
    unclipped = np.asarray(got["layers"]["attn"]["query"])[:, :, gamma[0] == 1]
    np.testing.assert_array_equal(unclipped[0], np.asarray(updates["layers"]["attn"]["query"])
                                  [0][:, gamma[0] == 1])
    np.testing.assert_array_equal(got["layers"]["attn"]["value"],
                                  updates["layers"]["attn"]["value"])


def test_clip_refuses_what_it_cannot_clip():
    params = _tree(0)
    tx = qk_clip(THRESHOLD)
    with pytest.raises(ValueError, match="attn_logit_max"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(ValueError, match="no query/key params"):
        tx.update(params, tx.init(params), params, attn_logit_max={"blocks/attn": MAXIMA})
    with pytest.raises(ValueError, match="threshold"):
        qk_clip(0.0)


def test_config_refuses_a_pipeline_and_bad_values():
    with pytest.raises(ConfigError, match="optimizer.params.qk_clip"):
        js.load_config(None, overrides=[*TINY, "optimizer.params.qk_clip=0"])
    with pytest.raises(ConfigError, match="optimizer.params.qk_clip_alpha"):
        js.load_config(None, overrides=[*TINY, "optimizer.params.qk_clip_alpha=2"])
    with pytest.raises(ConfigError, match="optimizer.params.qk_clip with pipeline"):
        js.initialize(js.load_config(None, overrides=[
            *TINY, "optimizer.params.qk_clip=50", "mesh.data=4", "mesh.pipe=2"]))


# ------------------------------------------------------------------------ the engine, 8 devices

# lr 0: the step changes nothing but what QK-clip scales, so the expected params are the
# initial ones with each clipped head's projections times gamma^(1/2)
ENGINE = [*TINY, "optimizer.params.lr=0", "bf16.enabled=false", "mesh.data=8"]
# two microbatches: the maxima are maxima over them (and over devices: explicit ZeRO-3's map)
CASES = {
    "zero3_explicit": ["zero_optimization.stage=3", "zero_optimization.collectives=explicit",
                       "gradient_accumulation_steps=2"],
    "offload_optimizer_host": ["zero_optimization.stage=2", "gradient_accumulation_steps=2",
                               "zero_optimization.offload_optimizer.device=cpu",
                               "zero_optimization.offload_optimizer.update_on=host"],
}


def _maxima(config, params, batch):
    """The model's per-head logit maxima on `batch`, applied outside the engine."""
    model = build_gpt(config.model, record_logit_max=True)
    _, state = model.apply({"params": params}, batch["inputs"], mutable=[LOGIT_MAX])
    return jax.device_get(logit_maxima(state))


@pytest.mark.parametrize("case", list(CASES))
def test_engine_clips_the_heads_past_the_threshold(case):
    config = js.load_config(None, overrides=[*ENGINE, *CASES[case]])
    batch = TokenDataset.from_config(config.data, seed=0).batch(0, global_batch=16)
    init = nn.unbox(build_gpt(config.model).init(jax.random.key(0), batch["inputs"])["params"])
    before = _maxima(config, init, batch)["layers/attn"]  # [layers, heads]
    threshold = float(np.median(before))  # half the heads clip
    engine = js.initialize(js.load_config(config, overrides=[
        f"optimizer.params.qk_clip={threshold}"]))
    state, metrics = engine.train_step(engine.init(jax.random.key(0), params=init), batch)

    rho = gpt_rtol(tokens=16 * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)
    np.testing.assert_allclose(metrics[LOGIT_MAX], before.max(), rtol=rho)
    scale = np.sqrt(np.minimum(1.0, threshold / before))
    attn = init["layers"]["attn"]
    got = jax.device_get(state.params)["layers"]["attn"]
    assert_close(got["query"], attn["query"] * scale[:, None, :, None], rtol=rho)
    assert_close(got["key"], attn["key"] * scale[:, None, :, None], rtol=rho)
    np.testing.assert_array_equal(got["value"], attn["value"])
    # the first layer sees the same inputs: its clipped heads' largest logit is now the threshold
    after = _maxima(config, jax.device_get(state.params), batch)["layers/attn"]
    np.testing.assert_allclose(after[0], np.minimum(before[0], threshold), rtol=rho)


def test_the_planner_counts_the_statistic():
    """QK-clip's statistic is one more `q·kᵀ` per layer in the forward pass: 2·seq·d FLOPs a
    token a layer in the planner's estimate."""
    from jaxspeed.autoplan.estimate import estimate
    from jaxspeed.autoplan.space import from_config
    from jaxspeed.config.cluster import load_cluster

    cluster = load_cluster("8xh100-nvlink")
    base = js.load_config("configs/gpt_tiny.yaml", overrides=["mesh.data=8", "optimizer.type=Muon"])
    clipped = js.load_config(base, overrides=["optimizer.params.qk_clip=100"])
    plan = from_config(base, {"data": 8})
    m, seq = base.model, base.data.seq_len
    tokens = plan.micro_batch * plan.accumulation * 8 * seq
    extra = estimate(clipped, plan, cluster).flops - estimate(base, plan, cluster).flops
    assert extra == pytest.approx(tokens * 2 * m.n_layers * seq * m.d_model / cluster.devices)
