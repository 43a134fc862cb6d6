"""The planner's model of a MoE GPT: the routed experts are their owners' (split over `expert`,
moved over the other batch axes only), a token meets `k` of them, and what crosses the expert
axis is what the layer's strategy moves (the flat exchange: as many bytes as the compiled
step's), priced on the hosts the axis spans as `parallelism: auto` prices it."""

import json

import pytest

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.estimate import estimate
from jaxspeed.autoplan.moe_exchange import exchange
from jaxspeed.autoplan.space import from_config
from jaxspeed.cli import main
from jaxspeed.config import load_config
from jaxspeed.config.cluster import load_cluster
from jaxspeed.cost.flops import layer_matmul_params
from clusters import two_hosts

SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
         "model.moe.d_ff=32", "model.max_seq_len=32", "data.seq_len=32",
         "train_micro_batch_size_per_device=2"]
D, E, H = 32, 8, 32  # d_model, experts, expert d_ff (gelu: 2 matrices)


def _config(*overrides):
    return load_config("configs/gpt_moe.yaml", overrides=[*SMALL, *overrides])


def test_the_experts_are_counted_apart_and_a_token_meets_k_of_them():
    config = _config()
    counts = traffic.param_counts(config)
    expert = 2 * D * H
    assert counts["layer_expert"] * 2 == E * expert  # one MoE layer of 2
    dense_ffn, router = 2 * D * 64, D * E
    assert counts["layer_matmul"] * 2 == 2 * 4 * D * D + dense_ffn + router
    assert layer_matmul_params(config.model) == 2 * 4 * D * D + dense_ffn + router + 2 * expert
    assert traffic.param_counts(_config("model.moe=null"))["layer_expert"] == 0


def test_zero3_moves_the_experts_over_data_only():
    config = _config("mesh.data=2", "mesh.expert=4")
    plan = from_config(config, {"data": 2, "expert": 4})
    moved = {t.name: t for t in traffic.step_transfers(config, plan)}
    dense = [t for name, t in moved.items() if name.startswith("zero3.") and "experts" not in name]
    experts = [t for name, t in moved.items() if name.startswith("zero3.experts.")]
    assert dense and all(t.axes == ("data", "expert") for t in dense)
    assert experts and all(t.axes == ("data",) for t in experts)
    gathered = sum(t.nbytes * t.count for t in experts if t.kind == "all-gather")
    assert gathered == pytest.approx(E // 4 * 2 * D * H * 4)  # the owned experts, fp32
    alone = from_config(_config("mesh.data=1", "mesh.expert=8"), {"expert": 8})
    assert not [t for t in traffic.step_transfers(config, alone) if "experts" in t.name]


def test_state_splits_the_experts_over_their_owners_before_zero():
    cluster = load_cluster("8xh100-nvlink")
    counts = traffic.param_counts(_config())
    dense = 2 * (counts["layer_matmul"] + counts["layer_norm"]) + counts["embed"] + counts["final_norm"]
    experts = 2 * counts["layer_expert"]
    for stage, params in ((0, dense + experts / 4), (3, (dense + experts) / 8)):
        config = _config("mesh.data=2", "mesh.expert=4", f"zero_optimization.stage={stage}")
        plan = from_config(config, {"data": 2, "expert": 4})
        assert estimate(config, plan, cluster).state_bytes == pytest.approx(16 * params, rel=1e-9)


def test_the_exchange_moves_what_the_compiled_step_moves(capsys):
    """Flat: four all-to-alls of `[E, C, M]` a MoE layer and micro-step, C = ceil(k 1.25 T /
    E), the bytes `plan` reads from XLA's compiled step."""
    config = _config("mesh.data=1", "mesh.expert=8")
    plan = from_config(config, {"expert": 8})
    sizes = traffic.mesh_sizes(plan.sizes, 1)
    flat = exchange(config, plan, sizes, load_cluster("8xh100-nvlink"))
    capacity = -(-2 * 5 * 64 // (4 * E))  # k=2, capacity factor 1.25, 64 tokens a device
    assert flat.strategy == "expert" and flat.times == 1
    assert flat.mesh == {"host": 1, "expert": 8, "tensor": 1}
    assert flat.collectives == [("all-to-all", E * capacity * D * 4, ("host", "expert"), 4)]
    assert exchange(_config("model.moe=null"), plan, sizes, load_cluster("8xh100-nvlink")) is None
    sets = [a for s in [*SMALL, "mesh.data=1", "mesh.expert=8"] for a in ("--set", s)]
    assert main(["plan", "configs/gpt_moe.yaml", "--json", *sets]) == 0
    compiled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"]
    assert compiled["collective_bytes"]["all-to-all"] == E * capacity * D * 4 * 4


def test_the_exchange_is_priced_by_the_layers_strategy_on_the_hosts_it_spans(tmp_path):
    """Over a slow link between 2 hosts of 4: `auto` prices as the strategy the layer would
    choose, the hierarchical exchange sends the tokens across (fewer bytes than the slots),
    and moving the experts (`expert_data`) wins once the buffer outgrows them."""
    cluster = load_cluster(two_hosts(tmp_path))

    def priced(micro, *options):
        config = _config("mesh.data=1", "mesh.expert=8", f"train_micro_batch_size_per_device={micro}",
                         *options)
        plan = from_config(config, {"expert": 8})
        sizes = traffic.mesh_sizes(plan.sizes, 1)
        return exchange(config, plan, sizes, cluster), estimate(config, plan, cluster)

    hier, hier_est = priced(1, "model.moe.all_to_all=hierarchical")
    assert hier.mesh == {"host": 2, "expert": 4, "tensor": 1}
    kinds = {kind: nbytes for kind, nbytes, _, _ in hier.collectives}
    assert kinds["collective-permute"] == 32 * D * 4 + 32 * 2 * 8  # 32 tokens + their routing
    flat, flat_est = priced(1)
    assert hier_est.cross_host_bytes < flat_est.cross_host_bytes
    for micro in (1, 16):
        auto, auto_est = priced(micro, "model.moe.parallelism=auto", "model.moe.all_to_all=hierarchical")
        fixed = {s: priced(micro, f"model.moe.parallelism={s}", "model.moe.all_to_all=hierarchical")[1]
                 for s in ("expert", "data", "expert_data")}
        assert auto_est.step_s == pytest.approx(min(e.step_s for e in fixed.values()))
        assert auto_est.step_s == pytest.approx(fixed[auto.strategy].step_s)
    assert priced(16, "model.moe.parallelism=auto")[0].strategy == "expert_data"


def test_zero3_over_an_expert_axis_across_processes_is_priced_in_two_stages(tmp_path):
    """No `host` axis names the hosts the expert axis spans, so the explicit step gathers and
    reduce-scatters the dense weights across the hosts and then inside them: the hierarchical
    algorithm's cost, less than gloo's flat ring over the 8 devices."""
    from jaxspeed.network.collectives import collective_time

    cluster = load_cluster(two_hosts(tmp_path))
    config = _config("mesh.data=1", "mesh.expert=8")
    plan = from_config(config, {"expert": 8})
    sizes = traffic.mesh_sizes(plan.sizes, 1)
    gathers = [t for t in traffic.step_transfers(config, plan, gloo=True)
               if t.kind == "all-gather"]
    assert gathers and all(t.axes == ("expert",) for t in gathers)

    def priced(algorithm):
        return sum(t.count * collective_time(
            t.kind, t.nbytes, t.axes, sizes, devices_per_host=4, intra=cluster.intra_host,
            inter=cluster.inter_host, algorithm=algorithm) for t in gathers)

    assert estimate(config, plan, cluster).comm_by_kind["all-gather"] == pytest.approx(
        priced("nccl"))
    assert priced("nccl") < priced("gloo")


def test_on_a_tensor_axis_the_experts_are_gathered_or_stay_split():
    """expert x tensor = 4 x 2 (Tutel's sharding degree 2): `expert` gathers a device's experts
    over `tensor` and moves half the slots; `expert_tensor` moves all of them and sums the
    FFN's output over `tensor` instead."""
    cluster, priced = load_cluster("8xh100-nvlink"), {}
    for strategy in ("expert", "expert_tensor"):
        config = _config("mesh.data=1", "mesh.expert=4", "mesh.tensor=2",
                         f"model.moe.parallelism={strategy}")
        plan = from_config(config, {"expert": 4, "tensor": 2})
        priced[strategy] = exchange(config, plan, traffic.mesh_sizes(plan.sizes, 1), cluster)
        assert estimate(config, plan, cluster).comm_by_kind["all-to-all"] > 0
    whole, split = priced["expert"], priced["expert_tensor"]
    assert whole.mesh == split.mesh == {"host": 1, "expert": 4, "tensor": 2}
    a2a = {name: [c[1] for c in ex.collectives if c[0] == "all-to-all"]
           for name, ex in priced.items()}
    assert a2a["expert_tensor"] == [2 * a2a["expert"][0]]
    experts = E // 4 * 2 * D * H * 4  # a device's 2 experts, whole, fp32
    assert ("all-gather", experts, ("tensor",), 1) in whole.collectives
    assert [c[0] for c in split.collectives if c[2] == ("tensor",)] == ["all-reduce"]
