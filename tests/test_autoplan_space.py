"""`plan --auto`'s search space: every legal mesh and plan, and no illegal one."""

import itertools

import pytest

import jaxspeed as js
from jaxspeed.autoplan.space import OFFLOAD, REMAT, Candidate, apply, candidates, meshes
from jaxspeed.runtime.mesh import CONFIG_AXES as AXES

BASE = ["model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4", "model.d_ff=64", "model.d_model=32",
        "data.seq_len=32", "model.max_seq_len=32", "train_batch_size=32"]


def all_meshes(devices):
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    for sizes in itertools.product(divisors, repeat=len(AXES)):
        if sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4] == devices:
            yield dict(zip(AXES, sizes))


def legal(m, *, per_host, heads=4, kv=2, layers=4, seq=32, batch=32, experts=1, d_ff=64):
    """The rules, written out independently of `meshes`."""
    inner = m["tensor"] * m["expert"] * m["sequence"]
    return (per_host % inner == 0 and heads % m["tensor"] == 0 and kv % m["tensor"] == 0
            and d_ff % m["tensor"] == 0 and experts % m["expert"] == 0 and layers % m["pipe"] == 0
            and batch % (m["data"] * m["expert"]) == 0
            and (m["sequence"] == 1 or (m["pipe"] == 1 and experts == 1 and seq % m["sequence"] == 0
                                        and (heads // m["tensor"]) % m["sequence"] == 0)))


@pytest.mark.parametrize("devices,per_host", [(8, 8), (16, 8), (16, 4), (32, 4), (64, 8)])
def test_meshes_are_exactly_the_legal_factorisations(devices, per_host):
    config = js.load_config(None, overrides=BASE)
    found = [tuple(m.values()) for m in meshes(config, devices, per_host)]
    want = {tuple(m.values()) for m in all_meshes(devices) if legal(m, per_host=per_host)}
    assert len(found) == len(set(found)) and set(found) == want and want


def test_illegal_axes_are_never_proposed():
    config = js.load_config(None, overrides=BASE)
    found = list(meshes(config, 16, 4))
    assert all(m["tensor"] * m["expert"] * m["sequence"] <= 4 for m in found)  # inside a host
    assert all(m["tensor"] in (1, 2) for m in found)  # 2 key/value heads
    assert all(m["expert"] == 1 for m in found)  # a dense model
    moe = js.load_config(None, overrides=[*BASE, "train_batch_size=24", "model.moe={num_experts: 6, k: 2}"])
    experts = {m["expert"] for m in meshes(moe, 12, 12)}
    assert experts == {1, 2, 3, 6}  # divisors of 6 experts, never 4 or 12
    assert all(m["sequence"] == 1 for m in meshes(moe, 12, 12))


def test_candidates_hold_the_global_batch_fixed():
    config = js.load_config(None, overrides=BASE)
    plans = list(candidates(config, 8, 8))
    assert plans and len(plans) == len(set(plans))
    for p in plans:
        s = p.sizes
        assert p.micro_batch * p.accumulation * s["data"] * s["expert"] == 32
        assert (p.schedule is not None) == (s["pipe"] > 1)
        assert p.offload in OFFLOAD and p.remat in REMAT and not (p.offload == "optimizer" and p.stage == 0)
        assert p.offload != "params" or p.stage == 3  # only sharded params are offloaded
        if s["pipe"] > 1:
            assert p.accumulation >= s["pipe"]
    assert {p.remat for p in plans} == set(REMAT) and {p.offload for p in plans} == set(OFFLOAD)


def test_apply_sets_the_plan_and_keeps_the_rest():
    config = js.load_config(None, overrides=[*BASE, "optimizer.params.lr=0.01"])
    plan = Candidate((("pipe", 2), ("data", 2), ("sequence", 1), ("expert", 1), ("tensor", 2)),
                     2, "full", 4, 4, "1f1b", "optimizer")
    out = apply(config, plan)
    assert out.mesh.axis_sizes() == {"pipe": 2, "data": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert out.zero_optimization.stage == 2 and out.zero_optimization.offload_optimizer.device == "cpu"
    assert out.activation_checkpointing.policy == "full"
    assert (out.train_micro_batch_size_per_device, out.gradient_accumulation_steps) == (4, 4)
    assert out.pipeline.schedule == "1f1b" and out.pipeline.num_microbatches == 4
    assert out.optimizer.params.lr == 0.01 and out.model == config.model


def test_apply_offloads_params_and_optimizer_together():
    config = js.load_config(None, overrides=BASE)
    plan = Candidate((("pipe", 1), ("data", 8), ("sequence", 1), ("expert", 1), ("tensor", 1)),
                     3, "offload_dots", 4, 1, None, "params")
    zero = apply(config, plan).zero_optimization
    assert (zero.stage, zero.offload_param.device, zero.offload_optimizer.device) == (3, "cpu", "cpu")
    assert apply(config, plan).activation_checkpointing.policy == "offload_dots"


def test_needs_a_global_batch():
    with pytest.raises(js.ConfigError, match="train_batch_size"):
        list(candidates(js.load_config(None, overrides=BASE[:-1]), 8, 8))


def test_analytic_estimate_follows_the_plan():
    from jaxspeed.autoplan.estimate import estimate, param_counts
    from jaxspeed.config.cluster import load_cluster

    config = js.load_config(None, overrides=BASE)
    cluster = load_cluster("8xh100-nvlink")

    def est(mesh, stage=0, remat="none", micro=4, accumulation=1, schedule=None, offload="none"):
        plan = Candidate(tuple((a, mesh.get(a, 1)) for a in AXES), stage, remat, micro, accumulation,
                         schedule, offload)
        return estimate(config, plan, cluster)

    counts = param_counts(config)
    total = 4 * counts["layer_matmul"] + 4 * counts["layer_norm"] + counts["embed"] + counts["final_norm"]
    assert est({"data": 8}).state_bytes == 16 * total  # fp32 params + grads + Adam, replicated
    states = [est({"data": 8}, stage).state_bytes for stage in range(4)]
    assert states[0] > states[1] > states[2] > states[3]
    assert states[3] == pytest.approx(16 * total / 8, rel=1e-6)
    offloaded = est({"data": 8}, stage=1, offload="optimizer")
    assert offloaded.host_bytes == pytest.approx(8 * total / 8) and offloaded.state_bytes == 8 * total
    acts = {r: est({"data": 8}, remat=r) for r in REMAT}
    assert (acts["none"].activation_bytes > acts["dots_with_no_batch_dims_saveable"].activation_bytes
            > acts["full"].activation_bytes)
    # dots_saveable also keeps each layer's fp32 attention scores: 4 heads x 32 keys a token
    scores = acts["dots_saveable"].activation_bytes - acts["dots_with_no_batch_dims_saveable"].activation_bytes
    assert scores == pytest.approx(4 * 4 * 32 * 4 * 32 * 4, rel=1e-6)  # layers x tokens x heads x L x 4 B
    # offload_dots: the device keeps what full remat keeps; the projections go to the host
    # and back each micro-step, at the host link's rate
    offload_dots = acts["offload_dots"]
    assert offload_dots.activation_bytes == acts["full"].activation_bytes
    kept = acts["dots_with_no_batch_dims_saveable"].activation_bytes - acts["full"].activation_bytes
    assert offload_dots.host_bytes > 0 and offload_dots.host_s > 0 and acts["full"].host_s == 0
    slow = cluster.model_copy(update={"host_link": cluster.host_link.model_copy(update={"bandwidth_gbps": 1.0})})
    plan = Candidate(tuple((a, {"data": 8}.get(a, 1)) for a in AXES), 0, "offload_dots", 4, 1)
    assert estimate(config, plan, slow).host_s == pytest.approx(
        offload_dots.host_s * cluster.host_link.bandwidth_gbps)
    assert 0 < offload_dots.host_bytes <= kept + acts["full"].activation_bytes
    # parameter offload: the fp32 params join the moments on the host; a bf16/fp32 compute
    # copy stays, and fewer bytes cross the link than the optimizer offload's params coming back
    opt, params = est({"data": 8}, stage=3, offload="optimizer"), est({"data": 8}, stage=3, offload="params")
    assert params.host_bytes == pytest.approx(opt.host_bytes + 4 * total / 8, rel=1e-6)
    assert params.state_bytes <= opt.state_bytes and 0 < params.host_s <= opt.host_s
    assert est({"data": 8}).comm_by_kind.keys() == {"all-reduce"}  # ZeRO-0: the gradient all-reduce
    assert est({"data": 4, "tensor": 2}).comm_by_kind["all-reduce"] > 0
    piped = est({"pipe": 2, "data": 4}, micro=1, accumulation=4, schedule="1f1b")
    assert piped.bubble == pytest.approx(1 / 5) and "collective-permute" in piped.comm_by_kind
    assert piped.step_s > piped.compute_s / (1 - piped.bubble) - 1e-12
