"""ZeRO-3's two byte models agree: the planner's (`autoplan.traffic.step_transfers`, from the
config's parameter counts, no plan) and `sharding.zero_traffic` (from a built plan's leaves,
checked against the compiled step's HLO in `test_zero_step.py`).

The planner's transfers are in the full-buffer convention (a gather's output); a ring
collective over `peers` devices sends `(peers - 1) / peers` of it, which is what
`zero_traffic` counts, split into intra-host and cross-host bytes. Before this test, the
planner counted the once-per-step gathers once per microbatch, and left out the backward
gathers of a model gathered layer by layer without remat (0.54x the bytes)."""

import math

import pytest

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.space import from_config
from jaxspeed.config import load_config
from jaxspeed.runtime.mesh import HOST
from jaxspeed.train.engine import initialize
from jaxspeed.train.zero_step import step_traffic

#: The tiny GPT (d_model 256) with 2 layers, ZeRO-3 over data 8 on 2 emulated hosts.
TINY = ["model.n_layers=2", "data.seq_len=32", "model.max_seq_len=32", "zero_optimization.stage=3",
        "mesh.hosts=2", "mesh.data=8"]
Z = "zero_optimization."
PER_USE = Z + "max_live_parameters=0"
QW, QG, HPZ = Z + "zero_quantized_weights=true", Z + "zero_quantized_gradients=true", Z + "zero_hpz_partition_size=4"
REMAT = "activation_checkpointing.policy=full"
#: 2 data x 2 tensor in each host: the leaves' tensor parts gather inside each tensor group
TENSOR = ["mesh.data=4", "mesh.tensor=2"]


def _planner(config, sizes) -> dict[tuple[str, str], float]:
    """The planner's ZeRO-3 bytes one device sends a step: {(gather|scatter, intra|cross)}."""
    sent: dict[tuple[str, str], float] = {}
    for t in traffic.step_transfers(config, from_config(config, sizes), hosts=sizes[HOST]):
        peers = math.prod(sizes[a] for a in t.axes)
        key = ("gather" if t.kind == "all-gather" else "scatter",
               "cross" if HOST in t.axes else "intra")
        sent[key] = sent.get(key, 0.0) + t.nbytes * (peers - 1) / peers * t.count
    return sent


def _built(config, plan) -> dict[tuple[str, str], float]:
    """`zero_traffic`'s bytes for the same step, keyed as `_planner`'s."""
    sent: dict[tuple[str, str], float] = {}
    for name, (intra, cross) in step_traffic(config, plan).by_collective.items():
        kind = "scatter" if name == "reduce_scatter" else "gather"
        for where, nbytes in (("intra", intra), ("cross", cross)):
            if nbytes:
                sent[kind, where] = sent.get((kind, where), 0.0) + nbytes
    return sent


@pytest.mark.parametrize("overrides", [
    [],  # gathered once per step
    [PER_USE],  # layer by layer, no remat: the backward pass gathers the layers again
    [PER_USE, REMAT],
    ["bf16.enabled=true", PER_USE],
    ["train_batch_size=16", "gradient_accumulation_steps=2"],  # once a step, not a microbatch
    ["train_batch_size=16", "gradient_accumulation_steps=2", PER_USE],
    [HPZ, PER_USE, REMAT],
    [QW], [QW, PER_USE], [QW, PER_USE, REMAT],  # quantized: each leaf its own collective
    [QG], [QW, QG, HPZ, PER_USE, REMAT],
    [*TENSOR, PER_USE], [*TENSOR, PER_USE, REMAT],
    [*TENSOR, QW, QG, Z + "zero_hpz_partition_size=2", PER_USE, REMAT],
], ids=lambda o: " ".join(x.removeprefix(Z) for x in o) or "once per step")
def test_the_planner_prices_zero3_as_the_built_plan_does(overrides):
    config = load_config("configs/gpt_tiny.yaml", overrides=[*TINY, *overrides])
    engine = initialize(config)
    sizes = dict(engine.mesh.shape)
    planner, built = _planner(config, sizes), _built(config, engine.plan)
    assert set(planner) == set(built)
    # quantized, the planner pads an average leaf to whole blocks of 256 values, the plan each
    # leaf: a block's bytes at most per leaf and collective apart (under 1% at d_model 256)
    quantized = QW in overrides or QG in overrides
    assert planner == pytest.approx(built, rel=0.02 if quantized else 1e-9)
