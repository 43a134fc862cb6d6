"""Sequence parallelism: Ulysses and ring attention against one device, the balanced layout,
GPT training over `mesh.sequence`, checkpoints across it, and bad input."""

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
    x = jnp.broadcast_to(jnp.arange(length)[None, :, None], (2, length, 3))
    balanced = run_split(mesh, lambda x: to_layout(x, "sequence"), x)
    # device i holds chunks i and 2S-1-i of 2S: rows are the original positions
    np.testing.assert_array_equal(balanced[0, :, 0], layout_positions(length, shards, True))
    chunk = length // (2 * shards)
    for device, first in enumerate(chunk_order(shards, True)[::2]):
        assert balanced[0, 2 * chunk * device, 0] == first * chunk
    back = run_split(mesh, lambda x: from_layout(to_layout(x, "sequence"), "sequence"), x)
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "natural"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_attention_equals_one_device(mesh_name, impl, causal, load_balance):
    mesh = make_mesh(MESHES[mesh_name])
    length, heads, head_dim, block = 48, 8, 8, 4
    q, k, v, do = qkv_do(1, (2, length, heads, head_dim), jnp.float32)

    def split(q, k, v):
        if load_balance:
            q, k, v = (to_layout(x, "sequence") for x in (q, k, v))
        y = sequence_parallel_attention(
            q, k, v, impl=impl, axis="sequence", causal=causal, load_balance=load_balance,
            block_q=block, block_kv=block)
        return from_layout(y, "sequence") if load_balance else y

    def loss(attention):
        return lambda q, k, v, do: jnp.sum(attention(q, k, v) * do)

    got = run_split(mesh, split, q, k, v)
    got_grads = run_split(mesh, jax.grad(loss(split), argnums=(0, 1, 2)), q, k, v, do)
    dense = lambda q, k, v: dense_attention(q, k, v, causal=causal)  # noqa: E731
    want = dense(q, k, v)
    want_grads = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v, do)
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
    want = dense_attention(q, k, v, causal=True)
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


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset.from_config(tiny_config().data, seed=0)


def train(engine, state, dataset, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        state, metrics = engine.train_step(state, dataset.batch(step, global_batch=16))
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


@pytest.fixture(scope="module")
def one_device(dataset):
    """Plain optax on one device, from the engine's initial params (tests/test_engine.py)."""
    return reference_from(js.initialize(tiny_config("mesh.data=8")), dataset, n=STEPS)


@pytest.mark.parametrize("overrides", [
    ["mesh.sequence=4", "mesh.data=2", "zero_optimization.stage=3"],
    ["mesh.sequence=4", "mesh.data=2", "zero_optimization.stage=3",
     "model.sequence_parallel.impl=ring"],
    ["mesh.sequence=2", "mesh.tensor=2", "mesh.data=2"],
    ["mesh.sequence=2", "mesh.tensor=2", "mesh.data=2", "model.sequence_parallel.impl=ring",
     "model.sequence_parallel.load_balance=false"],
], ids=["seq4-data2-zero3-ulysses", "seq4-data2-zero3-ring", "seq2-tensor2-data2-ulysses",
        "seq2-tensor2-data2-ring-natural"])
def test_gpt_training_equals_one_device(dataset, one_device, overrides):
    """Ulysses keeps the natural layout (whole sequences are balanced already); ring trains on
    the balanced one unless told otherwise."""
    engine = js.initialize(tiny_config(*overrides))
    assert engine.abstract_batch()["inputs"].sharding.spec[1] == "sequence"
    state, losses = train(engine, engine.init(jax.random.key(0)), dataset, STEPS)
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_params, steps=STEPS, lr=LR, rho=RHO)


def test_learned_positions_use_global_positions(dataset):
    learned = ["model.positions=learned"]
    _, want = train(*_fresh(tiny_config("mesh.data=8", *learned)), dataset, STEPS)
    _, got = train(*_fresh(tiny_config("mesh.sequence=8", "mesh.data=1", *learned,
                                       "model.sequence_parallel.impl=ring")), dataset, STEPS)
    np.testing.assert_allclose(got, want, rtol=RHO)


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_bf16_and_remat_compose(dataset, impl):
    """The first step's loss and gradient norm in bf16 with full remat equal data 8's."""
    common = ["bf16.enabled=true", "activation_checkpointing.policy=full"]
    metrics = {}
    for name, mesh in (("data8", ["mesh.data=8"]),
                       ("seq4", ["mesh.sequence=4", "mesh.data=2", "zero_optimization.stage=1",
                                 f"model.sequence_parallel.impl={impl}"])):
        engine, state = _fresh(tiny_config(*common, *mesh))
        _, m = engine.train_step(state, dataset.batch(0, global_batch=16))
        metrics[name] = {k: float(m[k]) for k in ("loss", "grad_norm")}
    # tests/numerics.py point 4: per layer 8 reductions and 16 roundings to bf16 (see
    # test_models' bf16 test) plus 4 outside the layers; the backward pass triples both.
    layers = 2
    rtol = {"loss": mixed_rtol(width=16 * 32, depth=8 * layers + 4, casts=16 * layers + 4,
                               dtype="bfloat16"),
            "grad_norm": mixed_rtol(width=16 * 32, depth=3 * (8 * layers + 4),
                                    casts=3 * (16 * layers + 4), dtype="bfloat16")}
    for key, tol in rtol.items():
        np.testing.assert_allclose(metrics["seq4"][key], metrics["data8"][key], rtol=tol)


def _fresh(cfg):
    engine = js.initialize(cfg)
    return engine, engine.init(jax.random.key(0))


def test_zero_shards_state_over_sequence_but_params_never_split_by_it():
    engine = js.initialize(tiny_config("mesh.sequence=4", "mesh.data=2", "model.positions=learned",
                                       "zero_optimization.stage=3"))
    positions = engine.plan.leaves["pos_embedding"]  # logical ("length", "embed")
    assert positions.logical == ("length", "embed")
    assert positions.gathered == P(None, None)  # the rules never split a param over sequence
    assert "sequence" in str(positions.param) and "data" in str(positions.param)  # ZeRO does


def test_checkpoint_from_sequence4_restores_at_sequence1(tmp_path, dataset):
    engine, state = _fresh(tiny_config("mesh.sequence=4", "mesh.data=2",
                                       "zero_optimization.stage=2"))
    state, _ = train(engine, state, dataset, 2)
    engine.save(state, directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    _, kept = train(engine, state, dataset, 2, start=2)

    moved_engine = js.initialize(tiny_config("mesh.data=8", "zero_optimization.stage=2"))
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
    path = tmp_path / "long.json"
    for impl, kind in (("ulysses", "all-to-all"), ("ring", "collective-permute")):
        sp = {"impl": impl, "load_balance": False}  # no layout moves: only attention's
        cfg = {**CLI_TINY, "model": {**CLI_TINY["model"], "sequence_parallel": sp}}
        path.write_text(json.dumps(cfg))
        assert main(["plan", str(path), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["mesh"]["sequence"] == 4
        assert report["profile"]["collective_bytes"][kind] > 0


@pytest.mark.parametrize("impl", ["blocked", "xla"])
def test_ulysses_runs_block_sparse_attention_on_whole_sequences(dataset, impl):
    sparse = ["model.sparse_attention={mode: fixed, block: 8, num_local_blocks: 2, "
              "attention: unidirectional}", f"model.sparse_attention.impl={impl}"]
    _, want = train(*_fresh(tiny_config("mesh.data=8", *sparse)), dataset, 2)
    _, got = train(*_fresh(tiny_config("mesh.sequence=4", "mesh.data=2", *sparse)), dataset, 2)
    np.testing.assert_allclose(got, want, rtol=RHO)


def test_only_ring_uses_the_balanced_layout():
    from jaxspeed.models import build_gpt

    for impl, balanced in (("ulysses", False), ("ring", True)):
        cfg = tiny_config(f"model.sequence_parallel.impl={impl}")
        assert build_gpt(cfg.model).balanced is balanced
    cfg = tiny_config("model.sequence_parallel.impl=ring", "model.sequence_parallel.load_balance=false")
    assert build_gpt(cfg.model).balanced is False
