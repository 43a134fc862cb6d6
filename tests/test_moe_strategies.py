"""Tutel's adaptive parallelism (`jaxspeed.moe.strategies`): the exchanges it is built from, each
strategy against the single-device layer (forward and gradients), what crosses a host under
each, and `auto`'s choice by the cost model."""

import functools
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspeed.config.cluster import load_cluster
from jaxspeed.cost.hlo import collectives
from jaxspeed.errors import ConfigError
from jaxspeed.moe.all_to_all import within_host_all_to_all
from jaxspeed.sharding.two_level import gather_across_hosts
from jaxspeed.moe.layer import MoE
from jaxspeed.moe.strategies import STRATEGIES, choose, links_of, strategy_seconds
from jaxspeed.runtime.mesh import make_mesh
from clusters import two_hosts
from numerics import assert_close
from test_moe_routing_balance import EP, RTOL, _on_mesh_and_one_device

LOGGER = "jaxspeed.moe.strategies"


def _run(mesh, spec, fn, x):
    """`fn` under `shard_map` on `mesh` and its transpose at random cotangents."""
    body = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    out, vjp = jax.vjp(body, x)
    rng = np.random.default_rng(5)
    cot = jax.tree.map(lambda o: jnp.asarray(rng.normal(size=o.shape), jnp.float32), out)
    return out, vjp(cot)[0]


def test_within_host_all_to_all_is_the_all_to_all_of_each_host():
    """On 8 devices as 2 hosts x 4: the same as `all_to_all` over the inner axis of a
    (2, 4) mesh, values and transpose, exactly; split before, after and at the concatenated
    axis (one program a mesh)."""
    pairs = ((0, 1), (1, 0), (0, 0))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(8 * 8, 8, 3)), jnp.float32)
    ours = _run(make_mesh({"expert": 8}), P("expert"), lambda a: [
        within_host_all_to_all(a, "expert", split, concat, hosts=2) for split, concat in pairs], x)
    ref = _run(make_mesh({"data": 2, "expert": 4}), P(("data", "expert")), lambda a: [
        jax.lax.all_to_all(a, "expert", split, concat, tiled=True) for split, concat in pairs], x)
    chex.assert_trees_all_equal(ours, ref)


@pytest.mark.parametrize("hosts", [2, 4])
def test_gather_across_hosts_is_the_all_gather_over_hosts(hosts):
    x = jnp.asarray(np.random.default_rng(4).normal(size=(8 * 2, 5)), jnp.float32)
    mesh = make_mesh({"expert": 8})
    ref_mesh = make_mesh({"data": hosts, "expert": 8 // hosts})
    body = lambda a: gather_across_hosts(a, "expert", hosts=hosts)  # noqa: E731
    ref_body = lambda a: jax.lax.all_gather(a, "data", axis=0, tiled=True)  # noqa: E731
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    ref = jax.jit(jax.shard_map(ref_body, mesh=ref_mesh, in_specs=P(("data", "expert")),
                                out_specs=P(("data", "expert"))))
    chex.assert_trees_all_equal(out(x), ref(x))
    # the transpose sums each host's share back: the all-gather's, a reduce-scatter
    cot = jnp.asarray(np.random.default_rng(6).normal(size=out(x).shape), jnp.float32)
    assert_close(jax.vjp(out, x)[1](cot), jax.vjp(ref, x)[1](cot), rtol=1e-6)


def _cross_host_permute_bytes(hlo, host):
    """Bytes each collective-permute that crosses hosts (`host(device id)`) moves, per
    execution."""
    return [op.bytes for op in collectives(hlo, num_devices=8)
            if op.kind == "collective-permute" and op.groups
            and any(host(a) != host(b) for a, b in op.groups)]


@pytest.mark.parametrize("parallelism,axes", [
    # the experts gathered over `expert`, their gradients summed over `data` as well
    ("data", {"data": 2, "expert": 4}),
    # 2 hosts of 4 devices: the swap of the [hosts, per host] expert blocks is not its own
    # inverse, as it is for 2 hosts of 2 (an expert axis of 4: `tests/test_moe_expert_tensor.py`)
    ("expert_data", {"expert": 8}),
])
def test_each_strategy_equals_one_device(parallelism, axes):
    """The same outputs, routing and gradients as the single-device layer; `data` gathers
    the experts and exchanges no token; `expert_data` sends only the experts' weights (and
    their gradient) across the 2 hosts."""
    out, ref, hlo = _on_mesh_and_one_device(EP, axes, parallelism=parallelism, a2a_hosts=2)
    ((_, (y, metrics)), grads), ((_, (ref_y, ref_metrics)), ref_grads) = out, ref
    chex.assert_trees_all_equal(metrics["expert_counts"], ref_metrics["expert_counts"])
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)
    kinds = {op.kind for op in collectives(hlo, num_devices=8)}
    assert "all-to-all" not in kinds
    if parallelism == "data":
        assert "all-gather" in kinds
    else:
        ep = axes["expert"]  # the expert axis is innermost: its 2 hosts split it in halves
        shard = (EP["num_experts"] // ep) * 12 * 16 * 4  # E/ep experts' w_in (= w_out) bytes
        crossing = _cross_host_permute_bytes(hlo, lambda d: d % ep // (ep // 2))
        assert crossing and set(crossing) <= {shard}, crossing


def _links(tmp_path, inter_gbps):
    """The links of a 2-host cluster file, as the GPT's builder reads `model.moe.cluster`."""
    return links_of(load_cluster(two_hosts(tmp_path, inter_gbps)))


def test_the_cost_model_moves_the_tokens_or_the_weights_by_their_bytes(tmp_path):
    """Over a slow link: a buffer much smaller than the experts goes by `expert`; one much
    larger keeps the tokens inside the hosts (`expert_data`); `data` moves every expert
    across the whole axis, never cheaper here than moving them across hosts only."""
    slow = _links(tmp_path, 0.005)
    sizes = dict(weight_bytes=2**20, ep=4, hosts=2, cluster=slow)
    assert choose("auto", buffer_bytes=2**16, **sizes) == "expert"
    assert choose("auto", buffer_bytes=2**24, **sizes) == "expert_data"
    for buffer in (2**16, 2**24):
        prices = {s: strategy_seconds(s, buffer_bytes=buffer, **sizes) for s in STRATEGIES}
        assert prices["data"] >= prices["expert_data"]
    # a fixed strategy is what runs, whatever the prices
    assert choose("data", buffer_bytes=2**24, **sizes) == "data"
    # the hierarchical all-to-all's fewer messages are priced: cheaper on a high-latency link
    flat = strategy_seconds("expert", buffer_bytes=2**12, **sizes)
    assert strategy_seconds("expert", buffer_bytes=2**12, hierarchical=True, **sizes) < flat


def test_auto_picks_per_capacity_and_logs_the_choice(tmp_path, caplog):
    """With dynamic capacity each capacity bucket is its own compiled branch: `auto` prices
    each, so a step runs the strategy its measured load's bucket was priced cheapest at. The
    result is still the single-device layer's."""
    # experts of 12 x 16: 1.5 KiB each (w_in, w_out); buffers of 8 experts x C slots x 12
    cluster = _links(tmp_path, 0.005)
    # buckets of 16 and 8 slots, both priced `expert_data` on this link (a third bucket adds
    # another branch of the same strategy to compile)
    options = dict(EP, dynamic_capacity=True, capacity_factor=8.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out, ref, _ = _on_mesh_and_one_device(options, {"expert": 8}, parallelism="auto",
                                              a2a_hosts=2, cluster=cluster)
    ((_, (y, _)), grads), ((_, (ref_y, _)), ref_grads) = out, ref
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)
    chosen = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(chosen) >= 2, chosen  # one line per bucket traced
    assert all(line.startswith("MoE parallelism auto: ") for line in chosen)
    assert {line.split()[3] for line in chosen} <= set(STRATEGIES)


def test_parallelism_values_are_checked():
    def init(module):  # traced only: the layer checks its options before it computes
        jax.eval_shape(functools.partial(module.init, deterministic=True),
                       {"params": jax.random.key(0)}, jnp.zeros((8, 12)))

    with pytest.raises(ConfigError, match="MoE.parallelism must be one of"):
        init(MoE(**EP, parallelism="tensor"))
    # a layer takes links; a file name is for a config, which the GPT's builder reads
    with pytest.raises(ConfigError, match="MoE.cluster='two.yaml' is a file or preset name"):
        init(MoE(**EP, parallelism="auto", cluster="two.yaml"))


def test_a_config_names_a_cluster_file_the_gpt_reads(tmp_path):
    """`model.moe.cluster: FILE` reaches the MoE layers as that file's links."""
    from jaxspeed.config import load_config
    from jaxspeed.models.gpt import _moe_options

    path = two_hosts(tmp_path, 0.005)
    cfg = load_config("configs/gpt_moe.yaml", overrides=[
        "model.moe.parallelism=auto", f"model.moe.cluster={path}"]).model
    options = _moe_options(cfg.moe, cfg)
    assert options["cluster"] == links_of(load_cluster(path))
    assert options["cluster"].algorithm == "gloo"
    with pytest.raises(ConfigError, match="unknown cluster preset"):
        bad = load_config("configs/gpt_moe.yaml", overrides=["model.moe.cluster=nowhere"]).model
        _moe_options(bad.moe, bad)


def test_plan_counts_the_messages_that_cross_hosts():
    """`plan`'s profile: the flat all-to-all over 2 hosts x 4 sends 4 messages across per
    device, the hierarchical one 1 (each 4 times larger); rings are not counted."""
    from jaxspeed.cost.cross_host import cross_host_bytes, cross_host_messages
    from jaxspeed.cost.plan_table import format_profile
    from jaxspeed.moe.all_to_all import hierarchical_all_to_all

    mesh, hosts = make_mesh({"expert": 8}), [0] * 4 + [1] * 4
    x = jnp.zeros((8 * 16, 4), jnp.float32)

    def counted(fn):
        body = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
        text = body.lower(x).compile().as_text()
        return (cross_host_messages(text, num_devices=8, host_of=hosts),
                cross_host_bytes(text, num_devices=8, host_of=hosts))

    flat, flat_bytes = counted(lambda a: jax.lax.all_to_all(a, "expert", 0, 0, tiled=True))
    two, two_bytes = counted(lambda a: hierarchical_all_to_all(a, "expert", 0, 0, hosts=2))
    assert flat == {"all-to-all": 4, "collective-permute": 0}
    assert two == {"all-to-all": 0, "collective-permute": 1}
    assert counted(lambda a: jax.lax.all_gather(a, "expert", tiled=True)[:16])[0] == {
        "all-to-all": 0, "collective-permute": 0}
    profile = {"flops": 8.0, "flops_per_device": 1.0, "peak_flops_per_device": None,
               "collective_bytes": flat_bytes, "cross_host_bytes": flat_bytes,
               "cross_host_messages": flat}
    assert any(line.strip().startswith("all-to-all") and line.endswith("in 4 messages")
               for line in format_profile(profile))
    assert two_bytes["collective-permute"] > 0
