"""The planner's model of a MoE GPT: the routed experts are their owners' (split over `expert`,
moved over the other batch axes only), a token meets `k` of them, and the layers' token
exchange is four all-to-alls of the capacity buffer per micro-step, as many bytes as the
compiled step's."""

import json

import pytest

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.cluster import load_cluster
from jaxspeed.autoplan.estimate import estimate
from jaxspeed.autoplan.space import from_config
from jaxspeed.cli import main
from jaxspeed.config import load_config
from jaxspeed.cost.flops import layer_matmul_params

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
    """Four all-to-alls of `[E, C, M]` a MoE layer and micro-step, C = ceil(k 1.25 T / E): the
    bytes `plan` reads from XLA's compiled step."""
    config = _config("mesh.data=1", "mesh.expert=8")
    plan = from_config(config, {"expert": 8})
    exchange = traffic.moe_exchange(config, plan, traffic.mesh_sizes(plan.sizes, 1))
    capacity = -(-2 * 5 * 64 // (4 * E))  # k=2, capacity factor 1.25, 64 tokens a device
    assert exchange.nbytes == E * capacity * D * 4 and exchange.count == 4
    assert traffic.moe_exchange(_config("model.moe=null"), plan, {"expert": 8}) is None
    sets = [a for s in [*SMALL, "mesh.data=1", "mesh.expert=8"] for a in ("--set", s)]
    assert main(["plan", "configs/gpt_moe.yaml", "--json", *sets]) == 0
    compiled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"]
    assert compiled["collective_bytes"]["all-to-all"] == exchange.nbytes * exchange.count
