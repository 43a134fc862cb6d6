"""ZeRO-3 with explicit collectives and ZeRO++'s switches in the engine, on the tiny GPT.

- Explicit ZeRO-3 against a single-device optax reference: loss and params after 2 steps, and
  the eval loss of the trained params, at the tolerance of two orders of the same fp32
  program (`tests/numerics.py`); its FLOP count against the sharding path's
  (`collectives: compiler`, itself checked against that reference in `test_engine`).
- Each switch trained against explicit ZeRO-3. hpZ reorders the same fp32 sums (the same
  tolerance). qwZ / qgZ round each weight / gradient to within `1 / (2 qmax)` of its block's
  largest magnitude (`jaxspeed.ops.quantize`): 1/254 for int8, 1/14 for int4, with mean-zero
  (round-to-nearest) errors. The loss, a mean over tokens of a smooth function of those
  inputs, moves by less than they do, so its relative distance from ZeRO-3's after a few
  steps is held to that same fraction (measured: about a tenth of it).
- The compiled step's collectives, read from its HLO (`jaxspeed.cost.hlo`): a reduce-scatter
  where the sharding path all-reduces, qwZ's gathers in s8, qgZ's all-to-alls in packed u8,
  hpZ's per-layer gathers inside the host (the bytes against the planner's model:
  `test_zero3_traffic.py`).

Compiling the step is most of these tests' time, so each config's engine is built once a
process (`engine_for`, which `test_zero3_traffic` and `test_zero_grouped` use too) and each
run of it once (`run`): a test that trains, evaluates or reads the HLO of a config another test
has compiled compiles nothing. The engines start from one draw of the params (`params0`,
through `init(params=...)`: their init programs are the optimizer's zeros, not the model's
init again for each layout; the MoE's own init draws its params).
"""

import functools
import json
import os

import jax
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.config import load_config
from jaxspeed.cost import hlo
from jaxspeed.errors import ConfigError
from jaxspeed.models import build_gpt
from jaxspeed.ops import quantize as qz
from jaxspeed.ops.losses import lm_loss
from jaxspeed.ops.matmul import ENV
from jaxspeed.zero import layout as zl
from jaxspeed.runtime.distributed import over_gloo
from jaxspeed.zero.step import GLOO_BUCKET, NESTED_PIPELINE_JAX, RUN_BUCKET, switches_of
from test_engine import LR, RHO, batches, reference_from, tiny_config
from numerics import assert_adam_params_close

Z = "zero_optimization."
HOSTS2 = ["mesh.data=8", "mesh.hosts=2", Z + "stage=3", Z + "max_live_parameters=0"]
#: Two hosts x (2 data x 2 tensor): HSDP beside tensor parallelism inside each host.
TENSOR2 = ["mesh.data=4", "mesh.tensor=2", "mesh.hosts=2", Z + "stage=3",
           Z + "max_live_parameters=0"]
#: A pipeline nested in the step's map needs jax 0.12's XLA (`jaxspeed.zero.step.NESTED_PIPELINE_JAX`).
NESTED_PIPELINE = pytest.mark.skipif(jax.__version_info__ < NESTED_PIPELINE_JAX,
                                     reason="jax 0.11's XLA aborts on the nested manual axes")
#: Two hosts x (2 data x 2 pipeline stages), 1F1B over 2 microbatches.
PIPE2 = ["mesh.data=4", "mesh.pipe=2", "mesh.hosts=2", Z + "stage=3",
         "pipeline.num_microbatches=2"]
#: Stage 3 on one host against the single-device reference is in `test_engine`; here: two
#: hosts, with a tensor axis, offloaded, with a pipeline, and on one host with gradient
#: accumulation and remat (the recomputed layers gather again).
CASES = {
    # the switches' ZeRO-3 (`zero3_losses`)
    "hosts2/layer": HOSTS2,
    "hosts2/tensor2/layer": TENSOR2,
    # ZeRO-Offload: the layers' shards streamed in one at a time, the update on the device;
    # beside tensor, the update on the host (CPU-Adam)
    "hosts2/offload/layer": [*HOSTS2, Z + "offload_param.device=cpu",
                             Z + "offload_optimizer.device=cpu"],
    "hosts2/tensor2/offload-host-update": [
        *TENSOR2, Z + "offload_param.device=cpu", Z + "offload_optimizer.device=cpu",
        Z + "offload_optimizer.update_on=host"],
    # PP + ZeRO-3: the pipeline's map nested in the step's, each stage gathering its layers
    "hosts2/pipe2/layer": [*PIPE2, Z + "max_live_parameters=0"],
    "data8/layer/accum2/remat": ["mesh.data=8", Z + "stage=3", Z + "max_live_parameters=0",
                                 Z + "collectives=explicit", "gradient_accumulation_steps=2",
                                 "activation_checkpointing.policy=full"],
}


def train(cfg, dataset, steps, *, params=None):
    """A fresh engine of `cfg` (for a test that stubs what `initialize` reads) and `steps`
    steps of it from key 0 (with `params`: from those, `init(params=...)`)."""
    engine = js.initialize(cfg)
    return (engine, *_steps(engine, dataset, steps, params))


def _steps(engine, dataset, steps, params):
    state = engine.init(jax.random.key(0), params=params)
    losses = []
    for batch in batches(dataset, steps):
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


_ENGINES = {}


def engine_for(config):
    """The engine of `config`, built once a process. A bf16 program depends on
    `jaxspeed.ops.matmul.ENV` when it is traced (`test_zero3_traffic` keeps the dots bf16), so
    a bf16 config's engine is one per value of it."""
    key = json.dumps(config.to_dict(), sort_keys=True), (
        os.environ.get(ENV) if config.bf16.enabled else None)
    if key not in _ENGINES:
        _ENGINES[key] = js.initialize(config)
    return _ENGINES[key]


def engine_of(*overrides):
    return engine_for(tiny_config(*overrides))


@functools.cache
def _dataset():
    from jaxspeed.data import TokenDataset

    return TokenDataset.from_config(tiny_config().data, seed=0)


@pytest.fixture(scope="module")
def dataset():
    return _dataset()


@functools.cache
def params0():
    """The params key 0 draws for the tiny GPT (HOSTS2's init; the same on any layout:
    `test_engine.test_init_draws_the_same_params_on_any_layout`), on the host."""
    return jax.device_get(engine_of(*HOSTS2).init(jax.random.key(0)).params)


@functools.cache
def _run(engine, steps):
    moe = engine.config.model.moe is not None  # other params: its own init draws them
    return (engine, *_steps(engine, _dataset(), steps, None if moe else params0()))


def run(*overrides, steps):
    """`steps` steps of `engine_of(*overrides)` from `params0` (engine, state, losses), run
    once a process."""
    return _run(engine_of(*overrides), steps)


@functools.cache
def single_device(steps):
    """`test_engine.reference_from`: plain optax on one device from `params0`, `steps` steps
    (losses, params)."""
    return reference_from(engine_of(*HOSTS2), _dataset(), n=steps)


@functools.cache
def _plain_loss():
    model = build_gpt(tiny_config().model)
    return jax.jit(lambda p, batch: lm_loss(model.apply({"params": p}, batch["inputs"]), batch))


def plain_loss(params, batch) -> float:
    """The tiny GPT's loss on `batch` on one device (params on the host)."""
    return float(_plain_loss()(params, batch))


@pytest.mark.parametrize("case", [pytest.param(c, marks=NESTED_PIPELINE) if "pipe" in c else c
                                  for c in CASES])
def test_explicit_zero3_equals_sharding_path_and_single_device(dataset, case):
    """Loss and params after 2 steps and the eval loss against one device; the FLOPs the
    step counts (the map's body counts per device) against the sharding path's."""
    explicit, state, losses = run(*CASES[case], steps=2)
    assert explicit.explicit_zero is not None
    compiler = js.initialize(tiny_config(*CASES[case], Z + "collectives=compiler"))
    assert compiler.explicit_zero is None
    assert explicit.step_flops() == compiler.step_flops()
    ref_losses, ref_params = single_device(2)
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_params, steps=2, lr=LR, rho=RHO)
    batch = batches(dataset, 1)[0]
    np.testing.assert_allclose(float(explicit.eval_step(state, batch)["loss"]),
                               plain_loss(jax.device_get(state.params), batch), rtol=RHO)


SWITCH_STEPS = 6
SWITCHES = {  # name: (overrides, relative loss tolerance)
    "hpZ": ([Z + "zero_hpz_partition_size=4"], RHO),
    "qwZ": ([Z + "zero_quantized_weights=true"], 1 / (2 * qz.QMAX[8])),
    "qgZ-int8": ([Z + "zero_quantized_gradients=true", Z + "quantized_gradient_bits=8"],
                 1 / (2 * qz.QMAX[8])),
    "qgZ-int4": ([Z + "zero_quantized_gradients=true"], 1 / (2 * qz.QMAX[4])),
    "ZeRO++": ([Z + "zero_quantized_weights=true", Z + "zero_quantized_gradients=true",
                Z + "zero_hpz_partition_size=4"], 1 / (2 * qz.QMAX[4])),
}


@pytest.fixture(scope="module")
def zero3_losses():
    return run(*HOSTS2, steps=SWITCH_STEPS)[2]


@pytest.mark.parametrize("name", list(SWITCHES))
def test_switch_trains_like_zero3(zero3_losses, name):
    overrides, rtol = SWITCHES[name]
    _, _, losses = run(*HOSTS2, *overrides, steps=SWITCH_STEPS)
    np.testing.assert_allclose(losses, zero3_losses, rtol=rtol)
    assert losses[-1] < losses[0] - 0.3  # it trains
    if name != "hpZ":
        assert not np.array_equal(losses, zero3_losses)  # it did quantize


def test_bucketed_reduce_scatter_trains_like_zero3_in_pieces(zero3_losses):
    """`max_reduce_scatter_elements`: the gradients reduce-scattered in pieces of at most 1024
    elements, the same sums (so the same losses), and more, smaller reduce-scatters; the
    weights gathered in runs of whole leaves, the same bytes in more all-gathers."""
    engine, _, losses = run(*HOSTS2, Z + "max_reduce_scatter_elements=1024", steps=SWITCH_STEPS)
    np.testing.assert_allclose(losses, zero3_losses, rtol=RHO)
    whole = engine_of(*HOSTS2)

    def moved(e, kind):
        text = e.compile_train_step().as_text()
        return [op.bytes for op in hlo.collectives(text, num_devices=e.mesh.size)
                if op.kind == kind]

    pieces, leaves = moved(engine, "reduce-scatter"), moved(whole, "reduce-scatter")
    assert max(pieces) <= 4 * 1024 < max(leaves), (max(pieces), max(leaves))
    assert sum(pieces) == sum(leaves) and len(pieces) > len(leaves)
    runs, groups = moved(engine, "all-gather"), moved(whole, "all-gather")
    assert len(runs) > len(groups)
    # the same bytes but a layer's two norms: alone in a run, without remat, the backward
    # pass does not gather them again (in one buffer with the matrices, it must)
    norms = 2 * 64 * 4
    assert sum(runs) == sum(groups) - norms, (sum(runs), sum(groups))


#: ZeRO++ beside tensor parallelism, with remat (the recomputed layers gather again); also
#: `test_zero3_traffic`'s "tensor2/layer/zeropp".
TENSOR2_ZEROPP = [*TENSOR2, "activation_checkpointing.policy=full",
                  Z + "zero_quantized_weights=true", Z + "zero_quantized_gradients=true",
                  Z + "zero_hpz_partition_size=2"]


def test_zeropp_beside_tensor_parallelism_trains_like_zero3_and_moves_over_zero_axes_only():
    """ZeRO++ (qwZ + qgZ + hpZ) with `mesh.tensor=2`: the weights stay split over `tensor`,
    and every gather, reduce-scatter and all-to-all runs inside one tensor index's devices,
    on its tensor part of each leaf. Against the grid's ZeRO-3 beside tensor (remat recomputes
    the same values: within its rounding, far inside int4's tolerance)."""
    _, _, zero3 = run(*TENSOR2, steps=SWITCH_STEPS)
    engine, _, losses = run(*TENSOR2_ZEROPP, steps=SWITCH_STEPS)
    np.testing.assert_allclose(losses, zero3, rtol=1 / (2 * qz.QMAX[4]))
    assert not np.array_equal(losses, zero3) and losses[-1] < losses[0] - 0.3
    text = engine.compile_train_step().as_text()
    tensor_of = _coordinates(engine.mesh, "tensor")
    zero_ops = [op for op in hlo.collectives(text, num_devices=8) if op.kind != "all-reduce"]
    kinds = {op.kind for op in zero_ops}  # a shard too small to quantize: a reduce-scatter
    assert {"all-gather", "all-to-all"} <= kinds <= {"all-gather", "all-to-all", "reduce-scatter"}
    for op in zero_ops:
        assert all(len({tensor_of[d] for d in group}) == 1 for group in op.groups), op
    assert any(t.startswith("s8[") for t in _collective_types(text, "all-gather"))


def test_hpz_beside_an_expert_axis_trains_like_zero3_and_gathers_layers_inside_the_host():
    """hpZ with `mesh.expert=2` inside each host: the secondary copy over `host` first leaves
    the dense weights' blocks host-minor (`data, expert, host`), put back in the spec's order
    (`data, host, expert`) after the last stage; the same sums as ZeRO-3, so the same losses.
    Its step is `test_zero3_traffic`'s "expert2/layer/hpz" (the backward pass gathers each
    layer again, so the per-layer gathers run more than once without remat too)."""
    moe = ["mesh.data=4", "mesh.hosts=2", "mesh.expert=2", Z + "stage=3", "model.n_layers=4",
           Z + "max_live_parameters=0", "model.moe={num_experts: 2, every_n_layers: 2}"]
    _, _, zero3 = run(*moe, steps=3)
    engine, _, losses = run(*moe, Z + "zero_hpz_partition_size=4", steps=3)
    np.testing.assert_allclose(losses, zero3, rtol=RHO)
    ops = hlo.collectives(engine.compile_train_step().as_text(), num_devices=8)
    per_layer = [op for op in ops if op.kind == "all-gather" and op.executions > 1]
    assert per_layer and not any(_crosses_hosts(op) for op in per_layer)


@NESTED_PIPELINE
def test_zeropp_with_a_pipeline_trains_like_zero3_and_each_stage_gathers_its_own_layers():
    """ZeRO++ (qwZ + qgZ + hpZ) under a GPipe pipeline (run with its F/B table inside the
    step's map): every gather, reduce-scatter and all-to-all runs inside one stage's devices,
    on its own layers (small blocks, so that the tiny leaves quantize). Against the grid's
    ZeRO-3 under 1F1B (the same microbatches' sums in another order, far inside int4's
    tolerance)."""
    _, _, zero3 = run(*CASES["hosts2/pipe2/layer"], steps=SWITCH_STEPS)
    zeropp = [*CASES["hosts2/pipe2/layer"], "pipeline.schedule=gpipe",
              Z + "quantization_block_size=64", Z + "zero_quantized_weights=true",
              Z + "zero_quantized_gradients=true", Z + "zero_hpz_partition_size=2"]
    engine, _, losses = run(*zeropp, steps=SWITCH_STEPS)
    np.testing.assert_allclose(losses, zero3, rtol=1 / (2 * qz.QMAX[4]))
    assert not np.array_equal(losses, zero3) and losses[-1] < losses[0] - 0.3
    text = engine.compile_train_step().as_text()
    stage_of = _coordinates(engine.mesh, "pipe")
    zero_ops = [op for op in hlo.collectives(text, num_devices=8)
                if op.kind in ("all-gather", "reduce-scatter", "all-to-all")]
    assert {"all-gather", "all-to-all"} <= {op.kind for op in zero_ops}
    for op in zero_ops:
        assert all(len({stage_of[d] for d in group}) == 1 for group in op.groups), op
    assert any(t.startswith("s8[") for t in _collective_types(text, "all-gather"))


def _coordinates(mesh, axis: str) -> dict[int, int]:
    """Device id -> its index along `axis` of `mesh`."""
    where = mesh.axis_names.index(axis)
    return {d.id: index[where] for index, d in np.ndenumerate(mesh.devices)}


# -- the compiled step -------------------------------------------------------------------

N_LAYERS = 2
HOST_SIZE = 4  # devices per emulated host in HOSTS2


def _crosses_hosts(op) -> bool:
    return any(len({d // HOST_SIZE for d in group}) > 1 for group in op.groups)


def _step_collectives(*overrides):
    engine = engine_of(*overrides)
    text = engine.compile_train_step().as_text()
    return engine, text, hlo.collectives(text, num_devices=8)


def _collective_types(text, kind):
    return [line.split("=", 1)[1].split()[0] for line in text.splitlines()
            if f" {kind}(" in line or f" {kind}-start(" in line]


def test_zero3_step_reduce_scatters_where_the_sharding_path_all_reduces():
    engine, _, ops = _step_collectives(*HOSTS2)
    grads = engine.plan.bytes_per_device("param") * 8  # the whole fp32 gradient, in bytes
    scatter = sum(op.bytes * op.executions for op in ops if op.kind == "reduce-scatter")
    reduce = sum(op.bytes * op.executions for op in ops if op.kind == "all-reduce")
    assert scatter >= grads and reduce < 256  # only the loss/norm scalars are all-reduced
    _, _, ops = _step_collectives(*HOSTS2, Z + "collectives=compiler")
    assert sum(op.bytes * op.executions for op in ops if op.kind == "all-reduce") >= grads
    assert not [op for op in ops if op.kind == "reduce-scatter"]


#: All of ZeRO++ in bf16 with remat; also `test_zero3_traffic`'s "layer/zeropp".
ZEROPP_BF16 = [*HOSTS2, "bf16.enabled=true", "activation_checkpointing.policy=full",
               Z + "zero_quantized_weights=true", Z + "zero_quantized_gradients=true",
               Z + "zero_hpz_partition_size=4"]


def test_zeropp_step_moves_int8_weights_packed_int4_grads_and_crosses_hosts_once_a_step(
        monkeypatch):
    """The program a GPU runs: the bf16 dots stay bf16 (as `test_zero3_traffic` compiles it;
    a CPU without bf16 units would widen them, `jaxspeed.ops.matmul`)."""
    monkeypatch.setenv(ENV, "native")
    engine, text, ops = _step_collectives(*ZEROPP_BF16)
    gathers = _collective_types(text, "all-gather")
    assert any(t.startswith("s8[") for t in gathers), gathers
    # what is not s8 is a block scale or a shard too small to gain from quantizing
    big = [t for t in gathers if not t.startswith(("s8[", "f32[")) and "256" in t]
    assert not big, big
    assert any("u8[" in t for t in _collective_types(text, "all-to-all"))
    cross = [op for op in ops if _crosses_hosts(op) and op.kind != "all-reduce"]
    assert cross and all(op.executions == 1 for op in cross)  # hpZ: once a step
    per_layer = [op for op in ops if op.kind == "all-gather" and op.executions > 1]
    # forward and the recomputation in the backward pass, each layer, inside the host
    assert per_layer and all(op.executions == N_LAYERS for op in per_layer)
    assert not any(_crosses_hosts(op) for op in per_layer)


# -- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,match", [
    ([*HOSTS2, Z + "zero_hpz_partition_size=2"], r"zero_hpz_partition_size=2: accepted .* 4"),
    (["mesh.data=4", "mesh.sequence=2", Z + "stage=3", Z + "collectives=explicit"],
     r"collectives=explicit .* mesh.sequence=2"),
    (["mesh.data=4", "mesh.sequence=2", Z + "stage=3", Z + "zero_quantized_gradients=true"],
     r"zero_quantized_gradients .* mesh.sequence=2"),
    (["mesh.data=4", "mesh.hosts=2", "mesh.expert=2", Z + "stage=3",
      Z + "zero_hpz_partition_size=2", "model.moe={num_experts: 2, every_n_layers: 2}"],
     r"zero_hpz_partition_size=2: accepted values are 1 \(off\) or 4 .* x mesh.expert 2"),
])
def test_unsupported_combinations_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        js.initialize(tiny_config(*overrides))
    assert "\n" not in str(info.value)


def test_auto_keeps_the_sharding_path_where_explicit_is_unsupported():
    engine = js.initialize(tiny_config("mesh.data=4", "mesh.sequence=2", Z + "stage=3"))
    assert engine.explicit_zero is None


@pytest.mark.parametrize("overrides, explicit", [
    (["mesh.data=8"], False),  # one host: the sharding path (faster and lighter on CPU)
    (["mesh.data=8", Z + "zero_quantized_weights=true"], True),  # a ZeRO++ switch
    (["mesh.data=8", "mesh.hosts=2"], True),  # across hosts
])
def test_auto_runs_explicit_across_hosts_or_with_a_zeropp_switch(overrides, explicit):
    engine = js.initialize(tiny_config(*overrides, Z + "stage=3"))
    assert (engine.explicit_zero is not None) is explicit


@pytest.mark.parametrize("zero", [
    {"stage": 2, "zero_quantized_gradients": True},
    {"stage": 3, "collectives": "compiler", "zero_quantized_weights": True},
    {"stage": 3, "quantization_block_size": 7},
    {"stage": 3, "quantized_gradient_bits": 2},
    {"stage": 3, "max_reduce_scatter_elements": 0},
    {"stage": 3, "max_reduce_scatter_elements": "big"},
])
def test_switch_config_errors_name_the_key(zero):
    with pytest.raises(ConfigError, match="zero_optimization"):
        load_config({"zero_optimization": zero})


def test_deepspeed_zeropp_keys_map_directly():
    cfg = load_config({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 4}})
    zero = cfg.zero_optimization
    assert switches_of(zero) == zl.Switches(True, 4, True, 256, bucket=RUN_BUCKET)


def test_max_reduce_scatter_elements_auto_cuts_finer_over_gloo():
    zero = load_config({"zero_optimization": {"stage": 3}}).zero_optimization
    assert zero.max_reduce_scatter_elements == "auto"
    assert switches_of(zero).bucket == RUN_BUCKET
    assert switches_of(zero, gloo=True).bucket == GLOO_BUCKET < RUN_BUCKET
    fixed = zero.model_copy(update={"max_reduce_scatter_elements": 5000})
    assert switches_of(fixed).bucket == switches_of(fixed, gloo=True).bucket == 5000
    # one process's emulated devices: XLA's in-process collectives, not gloo
    assert not over_gloo(engine_of(*HOSTS2).mesh.devices.flat)


def test_host_major_shards_train_like_data_major_and_ring_inside_the_hosts():
    """`shard_order: host`: the same sums as data-major (with hpZ, whose stages' blocks are put
    back in order), and the all-gather over all 8 devices lists them host-major, so a ring
    over the group crosses hosts at 2 of its 8 edges, not at every one. Data-major: the
    default in one process (`test_shard_order_auto_is_host_major_over_gloo`), so the hpZ
    switch's run and the switches' ZeRO-3 step."""
    hpz = [*HOSTS2, Z + "zero_hpz_partition_size=4"]
    host = run(*hpz, Z + "shard_order=host", steps=SWITCH_STEPS)[2]
    np.testing.assert_allclose(host, run(*hpz, steps=SWITCH_STEPS)[2], rtol=RHO)

    def ring_crossings(*order):
        engine, text, ops = _step_collectives(*HOSTS2, *order)
        host_of = _coordinates(engine.mesh, "host")
        (group,) = {op.groups[0] for op in ops if op.kind == "all-gather"}
        return sum(host_of[a] != host_of[b] for a, b in zip(group, group[1:] + group[:1]))

    assert ring_crossings(Z + "shard_order=host") == 2 and ring_crossings() == 8


def test_shard_order_auto_is_host_major_over_gloo(monkeypatch):
    from jaxspeed.zero import step as zero_step

    config = tiny_config(*HOSTS2)
    mesh = engine_of(*HOSTS2).mesh
    assert not zero_step.host_major(config, mesh)  # in-process collectives: data-major
    assert zero_step.host_major(tiny_config(*HOSTS2, Z + "shard_order=host"), mesh)
    monkeypatch.setattr(zero_step, "over_gloo", lambda devices: True)
    assert zero_step.host_major(config, mesh)
    assert not zero_step.host_major(tiny_config(*HOSTS2, Z + "shard_order=data"), mesh)
    one_host = tiny_config("mesh.data=8", Z + "stage=3", Z + "shard_order=host")
    assert not zero_step.host_major(one_host, js.initialize(one_host).mesh)


def test_a_mesh_spans_hosts_with_a_host_axis_or_several_processes():
    """`collectives: auto` goes explicit across hosts: the slow link's `mesh.expert=4,
    mesh.data=1` has no `host` axis, its expert axis spans two processes."""
    from types import SimpleNamespace as NS

    from jaxspeed.zero.step import spans_hosts

    def mesh(processes, host=1):
        return NS(shape={"host": host, "data": 1, "expert": len(processes)},
                  devices=np.array([NS(process_index=p) for p in processes]))

    assert spans_hosts(mesh([0, 0, 1, 1]))
    assert not spans_hosts(mesh([0, 0, 0, 0]))
    assert spans_hosts(mesh([0, 0, 0, 0], host=2))
