"""ZeRO-3's one byte model (`autoplan.traffic.step_transfers`, what `plan` and the planner
price) against the compiled step's HLO, for each axis combination and switch the explicit
step runs: two emulated hosts, `tensor`, `expert` (a MoE), `pipe`, `offload_param`, gradient
accumulation, remat, bf16, both shard orders, and qwZ, qgZ and hpZ (each switch alone where
it changes what the model counts, and all of ZeRO++ together).

The model counts bytes in the full-buffer convention (a gather's output); a ring collective
over `peers` devices sends `(peers - 1) / peers` of it, and that is what is compared, split
into intra-host and cross-host bytes by gathers and by scatters (reduce-scatters, or qgZ's
all-to-alls). In full precision they agree exactly. Quantized, the model pads an average leaf
to whole blocks of `Switches.block` values where the step pads each leaf (and moves a leaf
smaller than a block as it is, `zero.comm.worth_quantizing`): they differ by at most one
block's quantized bytes and its scale per leaf and collective execution, which is the bound
asserted. The MoE's token exchange (all-to-alls over `expert`) is priced apart
(`autoplan.moe_exchange`) and left out here.

Nine cases are configs `test_zero_step` trains (layer by layer, offload, tensor2, both hpZ
orders, layer/qg, both ZeRO++, expert2): in one process they reuse its engines and compiled
steps (`test_zero_step.engine_for`), in another the persistent compilation cache's programs.
"""

import math

import pytest

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.space import from_config
from jaxspeed.cost import hlo
from jaxspeed.ops import quantize as qz
from jaxspeed.ops.matmul import ENV
from jaxspeed.runtime.mesh import HOST
from test_engine import tiny_config
from test_zero_step import NESTED_PIPELINE, _coordinates, _crosses_hosts, engine_for

Z = "zero_optimization."
#: Stage 3 across two hosts: explicit (`collectives: auto`, asserted), so that a case whose
#: config `test_zero_step` trains shares its engine and compiled step (`engine_for`).
HOSTS2 = ["mesh.data=8", "mesh.hosts=2", Z + "stage=3"]
LAYER, REMAT, BF16 = Z + "max_live_parameters=0", "activation_checkpointing.policy=full", "bf16.enabled=true"
QW, QG = Z + "zero_quantized_weights=true", Z + "zero_quantized_gradients=true"
TENSOR = ["mesh.data=4", "mesh.tensor=2"]  # 2 data x 2 tensor in each host
MOE = ["mesh.data=4", "mesh.expert=2", "model.n_layers=4",
       "model.moe={num_experts: 2, every_n_layers: 2}"]
CASES = {
    "once a step": [],
    "layer by layer": [LAYER],
    "layer/bf16/accum2": [LAYER, BF16, "gradient_accumulation_steps=2"],
    "layer/offload": [LAYER, Z + "offload_param.device=cpu", Z + "offload_optimizer.device=cpu"],
    # hpZ alone; with remat in the ZeRO++ cases (a layer's re-gather is far over their slack)
    "layer/hpz": [LAYER, Z + "zero_hpz_partition_size=4"],
    # the blocks reordered after hpZ's stages (host-major, or an expert axis): before they were
    # marked as gathered, the step kept every gathered layer for the backward pass, and so it
    # did with `offload_param`; without remat, only the model's re-gathers show it
    "layer/hpz/host-major": [LAYER, Z + "zero_hpz_partition_size=4", Z + "shard_order=host"],
    # qgZ's gradients reduced layer by layer, and once a step (host-major)
    "layer/qg": [LAYER, QG],
    "qg/host-major": [QG, Z + "shard_order=host"],
    "layer/zeropp": [LAYER, REMAT, BF16, QW, QG, Z + "zero_hpz_partition_size=4"],
    "tensor2/layer": [*TENSOR, LAYER],
    "tensor2/layer/zeropp": [*TENSOR, LAYER, REMAT, QW, QG, Z + "zero_hpz_partition_size=2"],
    "expert2/layer/hpz": [*MOE, LAYER, Z + "zero_hpz_partition_size=4"],
}


def _where(kind: str, crosses: bool) -> tuple[str, str]:
    return ("gather" if kind == "all-gather" else "scatter", "cross" if crosses else "intra")


def _compiled(engine) -> dict[tuple[str, str], float]:
    """Bytes a device sends a step in the compiled step's ZeRO collectives (not the loss's
    scalar all-reduces, nor the MoE's token exchange over `expert`)."""
    expert = engine.mesh.shape["expert"]
    sent: dict[tuple[str, str], float] = {}
    for op in hlo.collectives(engine.compile_train_step().as_text(), num_devices=8):
        # the token exchange (no case here has qgZ beside experts, whose gradients would move
        # in all-to-alls over `expert` too)
        exchange = op.kind == "all-to-all" and expert > 1 and len(op.groups[0]) == expert
        if op.kind == "all-reduce" or exchange:
            continue
        peers = len(op.groups[0])
        key = _where(op.kind, _crosses_hosts(op))
        sent[key] = sent.get(key, 0.0) + op.bytes * op.executions * (peers - 1) / peers
    return sent


def _priced(config, sizes) -> tuple[dict[tuple[str, str], float], float]:
    """The model's bytes, keyed as `_compiled`'s, and the quantized blocks' padding bound."""
    sent: dict[tuple[str, str], float] = {}
    slack = 0.0
    block = qz.BLOCK
    for t in traffic.step_transfers(config, from_config(config, sizes), hosts=sizes[HOST]):
        peers = math.prod(sizes[a] for a in t.axes)
        key = _where(t.kind, HOST in t.axes)
        sent[key] = sent.get(key, 0.0) + t.nbytes * t.count * (peers - 1) / peers
        if t.name.endswith(".values"):  # a quantized collective: its values, then its scales
            bits = 8 if t.kind == "all-gather" else config.zero_optimization.quantized_gradient_bits
            slack += t.count * (peers - 1) / peers * 2 * (block * bits / 8 + 4)
    return sent, slack


@pytest.mark.parametrize("case", list(CASES))
def test_the_byte_model_is_what_the_compiled_zero3_step_moves(case, monkeypatch):
    """The model prices the program a GPU runs. On a CPU without bf16 matmul units jaxspeed
    widens bf16 dots to fp32 (`jaxspeed.ops.matmul`), and XLA:CPU compiles that program with
    fewer gathers: `layer/bf16/accum2` moved 259 KB across hosts in gathers, against the
    489 KB of the model and of the native bf16 program (AVX2, jax 0.12.1). So the dots stay
    bf16 here, as on a GPU."""
    monkeypatch.setenv(ENV, "native")
    engine = engine_for(tiny_config(*HOSTS2, *CASES[case]))
    assert engine.explicit_zero is not None
    priced, slack = _priced(engine.config, dict(engine.mesh.shape))
    compiled = _compiled(engine)
    assert set(priced) == set(compiled)
    for key, nbytes in compiled.items():
        assert abs(priced[key] - nbytes) <= slack, (key, priced[key], nbytes, slack)


@NESTED_PIPELINE
def test_the_byte_model_prices_each_pipeline_stages_zero3_collectives():
    """With `mesh.pipe=2` (1F1B, 2 microbatches, hpZ): each stage gathers and reduce-scatters
    its own layers, in each forward and backward of its schedule. Those collectives sit in the
    schedule's `lax.switch` branches, which the HLO cannot count (each branch counts once a
    loop step), so this compares what each moves: the model's collectives, buffer by buffer,
    are the compiled step's ZeRO collectives (the pipeline's own permutes and sums over `pipe`
    left out), and every one runs inside one stage's devices."""
    engine = engine_for(tiny_config(
        "mesh.data=4", "mesh.pipe=2", "mesh.hosts=2", Z + "stage=3", LAYER,
        "pipeline.num_microbatches=2", Z + "zero_hpz_partition_size=2"))
    assert engine.explicit_zero is not None
    sizes = dict(engine.mesh.shape)
    stage_of = _coordinates(engine.mesh, "pipe")
    compiled, once = set(), 0
    for op in hlo.collectives(engine.compile_train_step().as_text(), num_devices=8):
        if op.kind in ("all-gather", "reduce-scatter"):
            assert all(len({stage_of[d] for d in group}) == 1 for group in op.groups), op
            compiled.add((op.kind, op.bytes, _crosses_hosts(op)))
            if op.computation.startswith("main"):  # outside the schedule's loop
                once += op.bytes * op.executions
    transfers = traffic.step_transfers(engine.config, from_config(engine.config, sizes),
                                       hosts=sizes[HOST])
    assert {(t.kind, t.nbytes, HOST in t.axes) for t in transfers} == compiled
    # once a step: hpZ's secondary copy of the layers and the rest, gathered and
    # reduce-scattered (the pipeline sums their gradients over its microbatches itself)
    assert sum(t.nbytes * t.count for t in transfers
               if HOST in t.axes or not t.name.endswith(".layers")) == once
