"""Tutel's sharding degree over the `tensor` axis (`jaxspeed.moe.expert_tensor`): every strategy
on experts stored split over `tensor` against the single-device layer (forward and gradients),
what each moves over `tensor` and the expert axis, and how the cost model weighs them."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.cost.hlo import collectives
from jaxspeed.errors import ConfigError
from jaxspeed.moe.experts import ExpertParams, init_expert_params
from jaxspeed.moe.parallel import GatingOptions, moe_ffn
from jaxspeed.moe.strategies import (
    STRATEGIES, choose, strategy_collectives, strategy_seconds)
from jaxspeed.runtime.mesh import make_mesh
from numerics import assert_close, program_rtol
from test_moe_routing_balance import EP, RTOL, _on_mesh_and_one_device

MESH = {"expert": 4, "tensor": 2}


def _tensor_pairs(op) -> bool:
    """Whether a collective's groups are the tensor pairs (devices 2i, 2i + 1)."""
    return bool(op.groups) and all(len(g) == 2 and g[0] // 2 == g[1] // 2 for g in op.groups)


@functools.cache
def _on_a_tensor_axis(parallelism):
    """`_on_mesh_and_one_device` on `MESH` under `parallelism`, once a file (its values for
    one test, its HLO for another)."""
    return _on_mesh_and_one_device(EP, MESH, num_groups=8, parallelism=parallelism, a2a_hosts=2)


@pytest.mark.parametrize("parallelism", STRATEGIES)
def test_each_strategy_on_a_tensor_axis_equals_one_device(parallelism):
    """expert x tensor = 4 x 2: the single-device layer's outputs, routing and gradients under
    every strategy, the experts' hidden units split over `tensor` as stored."""
    out, ref, hlo = _on_a_tensor_axis(parallelism)
    ((_, (y, metrics)), grads), ((_, (ref_y, ref_metrics)), ref_grads) = out, ref
    chex.assert_trees_all_equal(metrics["expert_counts"], ref_metrics["expert_counts"])
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)
    gathers = [op for op in collectives(hlo, num_devices=8)
               if op.kind == "all-gather" and _tensor_pairs(op)]
    # `expert_tensor` leaves the hidden units split; every other strategy gathers them
    assert bool(gathers) == (parallelism != "expert_tensor"), gathers


def test_auto_per_capacity_bucket_on_a_tensor_axis_equals_one_device():
    """Dynamic capacity: each bucket's branch runs the strategy priced for it, whole or split
    over `tensor`; the result is still the single-device layer's. Buckets of 32 and 16 slots
    (at least 16), priced `data` and `expert`: two strategies in one step."""
    options = dict(EP, dynamic_capacity=True, capacity_factor=16.0, min_capacity=16)
    out, ref, _ = _on_mesh_and_one_device(options, MESH, num_groups=8, parallelism="auto",
                                          a2a_hosts=2)
    ((_, (y, _)), grads), ((_, (ref_y, _)), ref_grads) = out, ref
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)


def test_whole_experts_exchange_half_the_slots():
    """With the experts whole (`expert`) a device of a tensor pair exchanges half the pair's
    slots; with them split (`expert_tensor`) all of them, and sums the FFN's output over the
    pair instead (the programs `test_each_strategy_on_a_tensor_axis_equals_one_device` ran:
    `a2a_hosts` changes nothing in the flat exchange)."""
    def exchanged(parallelism):
        hlo = _on_a_tensor_axis(parallelism)[2]
        ops = collectives(hlo, num_devices=8)
        return (sum(op.bytes * op.executions for op in ops if op.kind == "all-to-all"),
                [op for op in ops if op.kind == "all-reduce" and _tensor_pairs(op)])

    whole, whole_sums = exchanged("expert")
    split, split_sums = exchanged("expert_tensor")
    assert whole > 0 and split == 2 * whole, (whole, split)
    assert split_sums and whole_sums  # the output (split: buffer-sized; whole: token-sized)


def _ffn_on_mesh(axes, opts, experts, x, kernel, groups=8):
    """`moe_ffn`'s output and gradients (experts, x) on `axes` (None: one device)."""
    def loss(experts, x):
        out = moe_ffn(x, kernel, experts, opts=opts, num_groups=groups)
        return jnp.sum(out.y * jnp.cos(jnp.arange(x.size).reshape(x.shape)))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    if axes is None:
        return fn(experts, x)
    mesh = make_mesh(axes)
    specs = ExpertParams(P("expert", None, "tensor"), P("expert", "tensor"),
                         P("expert", None, "tensor"), P("expert", "tensor"), P("expert"))
    if axes.get("expert", 1) == 1:
        specs = jax.tree.map(lambda s: P(None, *s[1:]), specs)
    with jax.set_mesh(mesh):
        placed = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(mesh, s)),
                              experts, specs)
        return fn(placed, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))


@functools.cache
def _swiglu_experts():
    """`(experts, x, kernel)`: 8 biased swiglu experts of 8 -> 12 -> 8, 64 tokens, a router."""
    rng = np.random.default_rng(11)
    m, h, e = 8, 12, 8
    experts = init_expert_params(jax.random.key(4), e, m, h, activation="swiglu", bias=True)
    experts = experts._replace(b_in=jnp.asarray(rng.normal(size=(e, h)), jnp.float32),
                               b_out=jnp.asarray(rng.normal(size=(e, m)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(64, m)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(m, e)), jnp.float32)
    return experts, x, kernel


def _swiglu_options(parallelism, drop):
    return GatingOptions(num_experts=8, k=2, capacity_factor=1.0, min_capacity=1,
                         use_rts=False, drop_tokens=drop, activation="swiglu",
                         parallelism=parallelism)


@functools.cache
def _swiglu_one_device(drop):
    """The single device's `_ffn_on_mesh` (its one device runs no strategy: any is `expert`)."""
    return _ffn_on_mesh(None, _swiglu_options("expert", drop), *_swiglu_experts())


@pytest.mark.parametrize("axes,parallelism,drop", [
    ({"expert": 4, "tensor": 2}, "expert", True),
    ({"expert": 4, "tensor": 2}, "expert_tensor", True),
    ({"expert": 4, "tensor": 2}, "expert", False),  # dropless: every token a slot
    ({"data": 4, "tensor": 2}, "expert", False),  # no expert axis: grouped matmuls
])
def test_biased_swiglu_experts_equal_one_device(axes, parallelism, drop):
    """Biased swiglu experts: the hidden units' biases split over `tensor` with them, the
    output's added once, whichever way the shares are summed."""
    ours = _ffn_on_mesh(axes, _swiglu_options(parallelism, drop), *_swiglu_experts())
    assert_close(ours, _swiglu_one_device(drop), rtol=program_rtol(width=64, depth=3 * 5))


def test_the_cost_model_weighs_the_gathered_experts_against_the_halved_buffer():
    """Over a uniform link: large experts and a small buffer stay split (`expert_tensor` moves
    no weight); a large buffer is cheaper whole (`expert` moves half of it). Without a tensor axis
    the two are one strategy, and the earlier wins."""
    sizes = dict(ep=4, hosts=1, tp=2, output_bytes=2**10)
    assert choose("auto", buffer_bytes=2**12, weight_bytes=2**22, **sizes) == "expert_tensor"
    big = dict(sizes, buffer_bytes=2**24, weight_bytes=2**16)
    assert strategy_seconds("expert", **big) < strategy_seconds("expert_tensor", **big) / 1.9
    one = dict(sizes, tp=1)
    assert strategy_collectives("expert", buffer_bytes=2**20, weight_bytes=2**12, **one) == \
        strategy_collectives("expert_tensor", buffer_bytes=2**20, weight_bytes=2**12, **one)
    assert choose("auto", buffer_bytes=2**12, weight_bytes=2**22, **one) == "expert"


def test_expert_tensor_without_a_tensor_axis_is_refused():
    from jaxspeed.config import load_config

    with pytest.raises(ConfigError, match="mesh.tensor=1 splits nothing"):
        load_config("configs/gpt_moe.yaml", overrides=["model.moe.parallelism=expert_tensor"])
    cfg = load_config("configs/gpt_moe.yaml", overrides=[
        "model.moe.parallelism=expert_tensor", "mesh.tensor=2", "mesh.data=1"])
    assert cfg.model.moe.parallelism == "expert_tensor"

