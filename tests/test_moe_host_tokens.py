"""The hierarchical exchange that sends a device's tokens across hosts instead of its capacity
slots (`jaxspeed.moe.host_tokens`): the single-device layer's result, forward and gradients,
the slot form's, and what crosses a host."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspeed.cost.hlo import collectives
from jaxspeed.moe import exchange as exchange_module
from jaxspeed.moe.experts import ExpertParams
from jaxspeed.moe.gating import top_k_gating
from jaxspeed.moe.host_tokens import sends_tokens
from jaxspeed.moe.parallel import GatingOptions
from jaxspeed.runtime.mesh import make_mesh
from jaxspeed.moe.strategies import strategy_seconds
from numerics import assert_close, program_rtol
from test_moe_routing_balance import EP, M, RTOL, X, _on_mesh_and_one_device
from test_moe_strategies import _cross_host_permute_bytes

TOKENS = X.shape[0] * X.shape[1] // 8  # a device's tokens (8 devices, one group each)
K = EP["k"]


def test_tokens_go_across_where_they_are_fewer_bytes_than_one_hosts_slots():
    assert sends_tokens(token_bytes=10, buffer_bytes=21, hosts=2)
    assert not sends_tokens(token_bytes=10, buffer_bytes=20, hosts=2)  # a tie: the slots
    assert not sends_tokens(token_bytes=1, buffer_bytes=100, hosts=1)  # one host: no link
    # priced by what crosses: the tokens, when fewer, make `expert` cheaper on a slow link
    sizes = dict(weight_bytes=2**20, ep=4, hosts=2, hierarchical=True)
    slots = strategy_seconds("expert", buffer_bytes=2**16, **sizes)
    tokens = strategy_seconds("expert", buffer_bytes=2**16, token_bytes=2**14, **sizes)
    assert tokens < slots
    assert strategy_seconds("expert", buffer_bytes=2**16, token_bytes=2**15, **sizes) == slots


def _host_of(axes, hosts):
    """The host of each device id: the expert axis (innermost) split into `hosts` blocks."""
    ep = axes["expert"]
    return lambda d: d % ep // (ep // hosts)


# ({"expert": 8}, 2 hosts, one group a device) is a part of the last case: more hosts than
# devices a host (the two stages differ in size, as 2 x 4 does), 2 groups a device.
@pytest.mark.parametrize("axes,hosts,extra,capacity_factor", [
    ({"data": 2, "expert": 4}, 2, dict(a2a_chunks=2), 2.0),  # chunks inside the host
    ({"expert": 8}, 8, {}, 5.5),  # a device a host: nothing to exchange inside
    ({"expert": 8}, 4, dict(num_groups=16), 3.0),  # 2 groups a device
])
def test_the_token_exchange_equals_one_device(axes, hosts, extra, capacity_factor):
    """The layer's outputs, routing and gradients; across hosts go a device's tokens with
    their combine weights (one message), their slots (int32) and the partial sums coming back,
    each smaller than the slots for one host the 2D all-to-all would send."""
    options = dict(EP, capacity_factor=capacity_factor)
    out, ref, hlo = _on_mesh_and_one_device(options, axes, all_to_all="hierarchical",
                                            a2a_hosts=hosts, **extra)
    ((_, (y, metrics)), grads), ((_, (ref_y, ref_metrics)), ref_grads) = out, ref
    chex.assert_trees_all_equal(metrics["expert_counts"], ref_metrics["expert_counts"])
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)

    groups = extra.get("num_groups", 8) // 8
    tokens = TOKENS  # one device's, whatever its groups
    capacity = -(-int(K * capacity_factor * tokens // groups) // EP["num_experts"])
    slots_for_a_host = EP["num_experts"] // hosts * groups * capacity * M * 4
    crossing = _cross_host_permute_bytes(hlo, _host_of(axes, hosts))
    assert set(crossing) == {tokens * (M + K) * 4, tokens * K * 4, tokens * M * 4}, crossing
    assert sum(set(crossing)) - tokens * M * 4 < slots_for_a_host  # forward, with routing
    assert not [op for op in collectives(hlo, num_devices=8) if op.kind == "all-to-all"]


def test_chunks_that_overlap_the_ffn_keep_the_slots(monkeypatch):
    """Where collectives run beside compute (XLA:GPU, stubbed here) and the slots go out in
    chunks, the slots cross, a chunk at a time (each chunk's exchange overlaps another's FFN;
    the tokens would cross in one piece first); the same result."""
    monkeypatch.setattr(exchange_module, "collectives_overlap", lambda: True)
    options = dict(EP, capacity_factor=2.0)
    out, ref, hlo = _on_mesh_and_one_device(options, {"expert": 8}, all_to_all="hierarchical",
                                            a2a_hosts=2, a2a_chunks=2)
    assert_close(out, ref, rtol=RTOL)
    capacity = -(-int(K * 2.0 * TOKENS) // EP["num_experts"])
    chunk_for_a_host = EP["num_experts"] // 2 * capacity // 2 * M * 4
    assert set(_cross_host_permute_bytes(hlo, _host_of({"expert": 8}, 2))) == {chunk_for_a_host}


def _exchange(dtype, *, tokens_form: bool, monkeypatch):
    """`exchange` on 8 devices as 2 hosts (top-2 of 8 experts, capacity factor 2), in `dtype`:
    `(y, d x, d experts, d combine weights)` and the compiled HLO."""
    if not tokens_form:
        monkeypatch.setattr(exchange_module, "tokens_cross", lambda sizes, strategy: False)
    rng = np.random.default_rng(8)
    experts, hidden = EP["num_experts"], EP["d_ff"]
    x = jnp.asarray(rng.normal(size=(8 * TOKENS, M)), dtype)
    logits = jnp.asarray(rng.normal(size=(8 * TOKENS, experts)), jnp.float32)
    w_in = jnp.asarray(rng.normal(size=(experts, M, hidden)) * 0.3, dtype)
    w_out = jnp.asarray(rng.normal(size=(experts, hidden, M)) * 0.3, dtype)
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    opts = GatingOptions(num_experts=experts, k=K, all_to_all="hierarchical", a2a_hosts=2)

    def loss(x, logits, w_in, w_out, cot):
        routing = top_k_gating(logits, K, 2.0, min_capacity=1)
        y, _ = exchange_module.exchange(x, routing, ExpertParams(w_in, w_out), groups=1,
                                        opts=opts, expert_axis="expert", ep=8)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * cot), "expert"), y

    spec = P("expert")
    body = jax.jit(jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                                 mesh=make_mesh({"expert": 8}), in_specs=(spec,) * 5,
                                 out_specs=((P(), spec), (spec,) * 4)))
    args = (x, logits, w_in, w_out, cot)
    compiled = body.lower(*args).compile()
    (_, y), grads = compiled(*args)
    return (y, grads), compiled.as_text()


@pytest.mark.parametrize("dtype,rtol", [
    (jnp.float32, program_rtol(width=K, depth=2)),
    # the partial sums round to bf16 before they add up: twice per token instead of once
    (jnp.bfloat16, program_rtol(width=K, depth=2, dtype="bfloat16")),
])
def test_the_token_exchange_equals_the_slot_exchange(monkeypatch, dtype, rtol):
    """The same exchange with the slots sent across (the tokens' form switched off): the same
    outputs and gradients (the routing's weights' included) up to the order the combine adds a
    token's choices; in bf16 the tokens and their fp32 weights go in two messages."""
    tokens, hlo = _exchange(dtype, tokens_form=True, monkeypatch=monkeypatch)
    slots, slot_hlo = _exchange(dtype, tokens_form=False, monkeypatch=monkeypatch)
    assert_close(tokens, slots, rtol=rtol)
    host = _host_of({"expert": 8}, 2)
    crossing = set(_cross_host_permute_bytes(hlo, host))
    if dtype == jnp.float32:
        assert crossing == {TOKENS * (M + K) * 4, TOKENS * K * 4, TOKENS * M * 4}
    else:  # tokens and partials (XLA:CPU moves bf16 as fp32); weights and slots
        assert crossing - {TOKENS * M * 2, TOKENS * M * 4} == {TOKENS * K * 4}
    assert max(_cross_host_permute_bytes(slot_hlo, host)) > max(crossing)
