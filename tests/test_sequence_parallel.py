"""Sequence parallelism: Ulysses and ring attention against one device, the balanced layout,
GPT training over `mesh.sequence`, checkpoints across it, and bad input.

The engines are built once per file (`engine_of`) and shared between tests: compiling is most
of these tests' time on CPU."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspeed as js
from jaxspeed.attention.sequence_parallel import (
    chunk_order,
    from_layout,
    layout_positions,
    sequence_parallel_attention,
    to_layout,
)
from jaxspeed.cli import main
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.checkpoint.export import export_params
from jaxspeed.runtime.mesh import make_mesh
from numerics import assert_adam_params_close, assert_close, gpt_rtol, mixed_rtol
from test_blocked_attention import attention_rtol, dense_attention, qkv_do
from test_engine import reference_from

MESHES = {"seq8": {"sequence": 8}, "seq4_data2": {"sequence": 4, "data": 2}}


def run_split(mesh, fn, *arrays):
    """`fn` on the arrays split as `[data, sequence]` rows/positions, under `mesh`."""
    sharding = NamedSharding(mesh, P("data", "sequence"))
    with jax.set_mesh(mesh):
        return jax.jit(fn)(*(jax.device_put(x, sharding) for x in arrays))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_layout_moves_chunk_pairs_and_back(mesh_name):
    mesh = make_mesh(MESHES[mesh_name])
    shards = mesh.shape["sequence"]
    length = 4 * shards
    x = np.broadcast_to(np.arange(length)[None, :, None], (2, length, 3))

    def there_and_back(x):  # one program
        balanced = to_layout(x, "sequence")
        return balanced, from_layout(balanced, "sequence")

    balanced, back = map(np.asarray, run_split(mesh, there_and_back, x))
    # device i holds chunks i and 2S-1-i of 2S: rows are the original positions
    np.testing.assert_array_equal(balanced[0, :, 0], layout_positions(length, shards, True))
    chunk = length // (2 * shards)
    for device, first in enumerate(chunk_order(shards, True)[::2]):
        assert balanced[0, 2 * chunk * device, 0] == first * chunk
    np.testing.assert_array_equal(back, x)


ATTENTION_SHAPE, ATTENTION_BLOCK = (2, 48, 8, 8), 4  # [batch, length, heads, head_dim]


def _attention_case(mesh_name, impl, causal, load_balance):
    ids = (mesh_name, impl, "causal" if causal else "full",
           "balanced" if load_balance else "natural")
    return pytest.param(mesh_name, impl, causal, load_balance, id="-".join(ids))


#: The paths of both impls, on seq4_data2 (the sequence axis manual beside an automatic one):
#: ring's every mask and layout (full: every chunk pair; causal: which pairs a device computes,
#: by step and layout); Ulysses' causal mask in both layouts (the balanced one puts the
#: gathered sequence back in original order, which only a causal mask depends on) and the full
#: one (Ulysses hands the mask to one device's kernel: no path of its own in the other layout).
#: On seq8 (the sequence axis alone, 8 shards: ring's chunks of 3 rows smaller than a block,
#: one head a device for Ulysses) the causal balanced layout of each impl, whose chunk pairs
#: and reordering depend the most on the shard count.
ATTENTION_CASES = [
    *(_attention_case("seq4_data2", "ring", causal, balanced)
      for causal in (True, False) for balanced in (True, False)),
    _attention_case("seq4_data2", "ulysses", True, True),
    _attention_case("seq4_data2", "ulysses", True, False),
    _attention_case("seq4_data2", "ulysses", False, True),
    _attention_case("seq8", "ring", True, True),
    _attention_case("seq8", "ulysses", True, True),
]


def out_and_grads(attention):
    """`(q, k, v, do) -> (attention(q, k, v), its q, k, v gradients for output gradient do)`:
    one program for the output and the backward pass."""
    def run(q, k, v, do):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(do)

    return run


@functools.cache
def dense_out_and_grads(causal):
    """The plain attention's output and gradients on `qkv_do(1, ATTENTION_SHAPE)`, on one
    device."""
    dense = functools.partial(dense_attention, causal=causal)
    return jax.jit(out_and_grads(dense))(*qkv_do(1, ATTENTION_SHAPE, jnp.float32))


@pytest.mark.parametrize("mesh_name, impl, causal, load_balance", ATTENTION_CASES)
def test_attention_equals_one_device(mesh_name, impl, causal, load_balance):
    """The output and the q, k, v gradients (one compiled program) equal one device's."""
    mesh = make_mesh(MESHES[mesh_name])
    length, block = ATTENTION_SHAPE[1], ATTENTION_BLOCK
    head_dim = ATTENTION_SHAPE[3]

    def split(q, k, v):
        if load_balance:
            q, k, v = (to_layout(x, "sequence") for x in (q, k, v))
        y = sequence_parallel_attention(
            q, k, v, impl=impl, axis="sequence", causal=causal, load_balance=load_balance,
            block_q=block, block_kv=block)
        return from_layout(y, "sequence") if load_balance else y

    got, got_grads = run_split(mesh, out_and_grads(split),
                               *qkv_do(1, ATTENTION_SHAPE, jnp.float32))
    want, want_grads = dense_out_and_grads(causal)
    # ring: a kernel block per (device, block) pair merged; ulysses: one device's kernel
    blocks = length // block
    assert_close(got, want, rtol=attention_rtol(
        length=length, head_dim=head_dim, blocks=blocks, dtype=jnp.float32, grads=False))
    rtol = attention_rtol(length=length, head_dim=head_dim, blocks=blocks, dtype=jnp.float32,
                          grads=True)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert_close(g, w, rtol=rtol), name


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_bf16_attention_equals_one_device(impl):
    mesh = make_mesh(MESHES["seq4_data2"])
    length, heads, head_dim = 32, 4, 8
    q, k, v, do = qkv_do(2, (2, length, heads, head_dim), jnp.bfloat16)

    def split(q, k, v):
        return sequence_parallel_attention(q, k, v, impl=impl, axis="sequence", causal=True,
                                           load_balance=False, block_q=4, block_kv=4)

    got = run_split(mesh, split, q, k, v)
    want = jax.jit(functools.partial(dense_attention, causal=True))(q, k, v)  # one program
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, rtol=attention_rtol(
        length=length, head_dim=head_dim, blocks=length // 4, dtype=jnp.bfloat16, grads=False))


def test_ulysses_heads_not_divisible_suggests_ring():
    mesh = make_mesh(MESHES["seq8"])
    q = jnp.zeros((1, 16, 4, 8))
    with pytest.raises(ConfigError, match="impl: ring"):
        run_split(mesh, lambda q: sequence_parallel_attention(
            q, q, q, impl="ulysses", axis="sequence", load_balance=False), q)


# -- the GPT over the sequence axis ----------------------------------------------------------

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
    "model.d_ff=128", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
    "optimizer.params.lr=0.003", "optimizer.params.weight_decay=0.1", "gradient_clipping=1.0",
    "scheduler.type=WarmupLR", "scheduler.params.warmup_num_steps=3",
    "scheduler.params.warmup_type=linear", "train_batch_size=16",
    "model.attention.impl=blocked", "model.attention.block_q=8", "model.attention.block_kv=8",
]
STEPS, LR = 3, 0.003
RHO = gpt_rtol(tokens=16 * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)


def tiny_config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@functools.cache
def engine_of(*overrides):
    """The engine of `tiny_config(*overrides)`, built (and its step compiled) once per file."""
    return js.initialize(tiny_config(*overrides))


@pytest.fixture(scope="module", autouse=True)
def _forget_engines():
    """The engines and results cached here live as long as this file's tests."""
    yield
    for cached in (engine_of, first_step_metrics, dense_out_and_grads):
        cached.cache_clear()


def _fresh(*overrides):
    engine = engine_of(*overrides)
    return engine, engine.init(jax.random.key(0))


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset.from_config(tiny_config().data, seed=0)


def train(engine, state, dataset, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        state, metrics = engine.train_step(state, dataset.batch(step, global_batch=16))
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


#: The meshes and impls GPT training runs on. Other tests reuse their engines: `one_device`
#: starts from the first's params, `test_bf16_and_remat_compose` compares with the `sequence` 4
#: ones, `test_plan_shows_the_sequence_axis_and_its_collectives` plans two.
GPT_CASES = {
    "seq4-data2-zero3-ulysses": ("mesh.sequence=4", "mesh.data=2", "zero_optimization.stage=3"),
    "seq4-data2-zero3-ring": ("mesh.sequence=4", "mesh.data=2", "zero_optimization.stage=3",
                              "model.sequence_parallel.impl=ring"),
    "seq2-tensor2-data2-ulysses": ("mesh.sequence=2", "mesh.tensor=2", "mesh.data=2"),
    "seq2-tensor2-data2-ring-natural": ("mesh.sequence=2", "mesh.tensor=2", "mesh.data=2",
                                        "model.sequence_parallel.impl=ring",
                                        "model.sequence_parallel.load_balance=false"),
}


@pytest.fixture(scope="module")
def one_device(dataset):
    """Plain optax on one device, from the engine's initial params (tests/test_engine.py):
    those of the first engine trained below (every mesh's `init` draws the same)."""
    return reference_from(engine_of(*GPT_CASES["seq4-data2-zero3-ulysses"]), dataset, n=STEPS)


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_gpt_training_equals_one_device(dataset, one_device, case):
    """Ulysses keeps the natural layout (whole sequences are balanced already); ring trains on
    the balanced one unless told otherwise."""
    engine = engine_of(*GPT_CASES[case])
    assert engine.abstract_batch()["inputs"].sharding.spec[1] == "sequence"
    state, losses = train(engine, engine.init(jax.random.key(0)), dataset, STEPS)
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_params, steps=STEPS, lr=LR, rho=RHO)


def test_learned_positions_use_global_positions(dataset):
    learned = ["model.positions=learned"]
    _, want = train(*_fresh("mesh.data=8", *learned), dataset, STEPS)
    _, got = train(*_fresh("mesh.sequence=8", "mesh.data=1", *learned,
                           "model.sequence_parallel.impl=ring"), dataset, STEPS)
    np.testing.assert_allclose(got, want, rtol=RHO)


@functools.cache
def first_step_metrics(dataset, *overrides):
    """The first step's loss and gradient norm of `engine_of(*overrides)`."""
    engine, state = _fresh(*overrides)
    _, metrics = engine.train_step(state, dataset.batch(0, global_batch=16))
    return {k: float(metrics[k]) for k in ("loss", "grad_norm")}


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_bf16_and_remat_compose(dataset, impl):
    """The first step's loss and gradient norm in bf16 with full remat equal fp32's: those of
    the same mesh and impl's engine that `test_gpt_training_equals_one_device` trains (and
    finds equal to one device), so no reference is compiled for this test."""
    metrics = {"fp32": first_step_metrics(dataset, *GPT_CASES[f"seq4-data2-zero3-{impl}"]),
               "bf16": first_step_metrics(dataset, "bf16.enabled=true",
                                          "activation_checkpointing.policy=full",
                                          "mesh.sequence=4", "mesh.data=2",
                                          "zero_optimization.stage=1",
                                          f"model.sequence_parallel.impl={impl}")}
    # tests/numerics.py point 4: per layer 8 reductions and 16 roundings to bf16 (see
    # test_models' bf16 test) plus 4 outside the layers; the backward pass triples both. That
    # bounds two such programs' distance; the fp32 one has no roundings to bf16, so it is
    # closer to the exact values than another bf16 program would be.
    layers = 2
    rtol = {"loss": mixed_rtol(width=16 * 32, depth=8 * layers + 4, casts=16 * layers + 4,
                               dtype="bfloat16"),
            "grad_norm": mixed_rtol(width=16 * 32, depth=3 * (8 * layers + 4),
                                    casts=3 * (16 * layers + 4), dtype="bfloat16")}
    for key, tol in rtol.items():
        np.testing.assert_allclose(metrics["bf16"][key], metrics["fp32"][key], rtol=tol)


def test_zero_shards_state_over_sequence_but_params_never_split_by_it():
    engine = js.initialize(tiny_config("mesh.sequence=4", "mesh.data=2", "model.positions=learned",
                                       "zero_optimization.stage=3"))
    positions = engine.plan.leaves["pos_embedding"]  # logical ("length", "embed")
    assert positions.logical == ("length", "embed")
    assert positions.gathered == P(None, None)  # the rules never split a param over sequence
    assert "sequence" in str(positions.param) and "data" in str(positions.param)  # ZeRO does


def test_checkpoint_from_sequence4_restores_at_sequence1(tmp_path, dataset):
    """ZeRO-2 state split over `sequence` 4 and `data` 2, restored onto `data` 8, trains on as
    it would have. The engines are `test_ulysses_runs_block_sparse_attention_on_whole_
    sequences`' (compiled once; a checkpoint does not depend on the attention)."""
    engine, state = _fresh("mesh.sequence=4", "mesh.data=2", *sparse_overrides("blocked"))
    state, _ = train(engine, state, dataset, 2)
    engine.save(state, directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    _, kept = train(engine, state, dataset, 2, start=2)

    moved_engine = engine_of("mesh.data=8", *sparse_overrides("blocked"))
    moved = moved_engine.restore(directory=tmp_path)
    _, moved_losses = train(moved_engine, moved, dataset, 2, start=2)
    np.testing.assert_allclose(moved_losses, kept, rtol=RHO)
    exported = export_params(tmp_path, tmp_path / "params.msgpack")  # onto one device
    assert exported.stat().st_size > 0


CLI_TINY = {
    "mesh": {"data": 2, "sequence": 4},
    "train_micro_batch_size_per_device": 1,
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64, "max_seq_len": 32},
    "data": {"seq_len": 32, "max_bytes": 300000},
}


@pytest.mark.parametrize("change, match", [
    ({"model": {**CLI_TINY["model"], "n_heads": 2}}, "impl: ring"),
    ({"data": {"seq_len": 28, "max_bytes": 300000},
      "model": {**CLI_TINY["model"], "sequence_parallel": {"impl": "ring"}}},
     "2 x sequence = 8 chunks"),
    ({"model": {**CLI_TINY["model"], "sequence_parallel": {"impl": "stripes"}}},
     "model.sequence_parallel.impl"),
    ({"model": {**CLI_TINY["model"], "moe": {"num_experts": 4}}}, "model.moe with sequence"),
], ids=["ulysses-heads", "balanced-length", "unknown-impl", "moe"])
def test_bad_input_is_one_clear_line(tmp_path, capsys, change, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**CLI_TINY, **change}))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert err.startswith("jaxspeed plan: error:") and len(err.splitlines()) <= 2, err


def test_plan_shows_the_sequence_axis_and_its_collectives(capsys, tmp_path):
    """`jaxspeed plan --json` of Ulysses' and the natural layout's ring engines (no layout
    moves: only attention's) that `test_gpt_training_equals_one_device` trains (their steps
    are compiled already: XLA's compilation cache loads them): each moves its impl's
    collective and not the other's."""
    path = tmp_path / "long.json"
    for case, kind, other in (
            ("seq4-data2-zero3-ulysses", "all-to-all", "collective-permute"),
            ("seq2-tensor2-data2-ring-natural", "collective-permute", "all-to-all")):
        cfg = tiny_config(*GPT_CASES[case])
        path.write_text(json.dumps(cfg.to_dict()))
        assert main(["plan", str(path), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["mesh"]["sequence"] == cfg.mesh.sequence > 1
        moved = report["profile"]["collective_bytes"]
        assert moved[kind] > 0 and moved[other] == 0, moved


def sparse_overrides(impl):
    """Block-sparse attention by `impl`, at ZeRO-2 (its state split over every axis)."""
    return ("model.sparse_attention={mode: fixed, block: 8, num_local_blocks: 2, "
            "attention: unidirectional}", f"model.sparse_attention.impl={impl}",
            "zero_optimization.stage=2")


@pytest.mark.parametrize("impl", ["blocked", "xla"])
def test_ulysses_runs_block_sparse_attention_on_whole_sequences(dataset, impl):
    sparse = sparse_overrides(impl)
    _, want = train(*_fresh("mesh.data=8", *sparse), dataset, 2)
    _, got = train(*_fresh("mesh.sequence=4", "mesh.data=2", *sparse), dataset, 2)
    np.testing.assert_allclose(got, want, rtol=RHO)


def test_only_ring_uses_the_balanced_layout():
    from jaxspeed.models import build_gpt

    for impl, balanced in (("ulysses", False), ("ring", True)):
        cfg = tiny_config(f"model.sequence_parallel.impl={impl}")
        assert build_gpt(cfg.model).balanced is balanced
    cfg = tiny_config("model.sequence_parallel.impl=ring", "model.sequence_parallel.load_balance=false")
    assert build_gpt(cfg.model).balanced is False
