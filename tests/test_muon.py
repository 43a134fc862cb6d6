"""Muon (`jaxspeed.optim.muon`): Newton–Schulz and the update against plain float64 references,
which leaves it treats as matrices, its config, and the engine on 8 devices against one."""

import functools
import inspect
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxspeed as js
from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.space import from_config
from jaxspeed.config.cluster import Link, PeakTflops, load_cluster, save_cluster
from jaxspeed.config.optimizer import MuonParams
from jaxspeed.cost import hlo
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.models import build_gpt
from jaxspeed.ops.losses import lm_loss
from jaxspeed.optim.muon import (NS_COEFFS, Layout, Matrix, layout_of, matrix_of, muon,
                                 newton_schulz, owner_dim)
from jaxspeed.optim.muon_price import Rates, newton_schulz_flops, owner_is_cheaper, seconds
from test_engine import MESHES, STAGE_OVERRIDES, STAGES
from numerics import (adam_params_atol, gpt_rtol, muon_params_atol, newton_schulz_gain,
                      program_rtol)


def reference_newton_schulz(x: np.ndarray, steps: int = 5) -> np.ndarray:
    """The quintic iteration on one matrix, in float64."""
    a, b, c = NS_COEFFS
    x = np.asarray(x, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(3, 16, 40), (2, 48, 8)])
def test_newton_schulz_matches_float64_and_orthogonalizes(shape):
    x = np.asarray(jax.random.normal(jax.random.key(0), shape))
    got = np.asarray(newton_schulz(jnp.asarray(x)))
    for i in range(shape[0]):
        want = reference_newton_schulz(x[i])
        gain = newton_schulz_gain(np.linalg.svd(x[i], compute_uv=False))
        rtol = gain * program_rtol(width=max(shape), depth=15)
        assert np.linalg.norm(got[i] - want) <= rtol * np.linalg.norm(want)
        singular = np.linalg.svd(got[i], compute_uv=False)
        assert 0.5 < singular.min() and singular.max() < 1.3  # about U V^T, not U S V^T


# A transformer's leaves, with Flax's logical axes: a scanned stack of 2 layers.
SHAPES = {
    "embedding": ((64, 16), ("vocab", "embed")),
    "head": ((16, 64), ("embed", "vocab")),
    "layers": {
        "query": ((2, 16, 4, 8), ("layers", "embed", "heads", "kv")),
        "out": ((2, 4, 8, 16), ("layers", "heads", "kv", "embed")),
        "wi": ((2, 16, 32), ("layers", "embed", "mlp")),
        "experts": ((2, 3, 32, 16), ("layers", "expert", "mlp", "embed")),
        "norm": {"scale": ((2, 16), ("layers", "embed"))},
        "bias": ((2, 32), ("layers", "mlp")),
    },
}
_is_spec = lambda x: isinstance(x, tuple) and isinstance(x[0], tuple)  # noqa: E731
PARAM_SHAPES = jax.tree.map(lambda s: s[0], SHAPES, is_leaf=_is_spec)
LOGICAL = jax.tree.map(lambda s: s[1], SHAPES, is_leaf=_is_spec)


def _matrices(split_heads):
    return jax.tree.map_with_path(
        lambda path, spec: matrix_of(path, spec[0], spec[1], split_heads=split_heads),
        SHAPES, is_leaf=_is_spec)


def test_which_leaves_are_matrices():
    m = _matrices(split_heads=False)
    assert m["embedding"] is None and m["head"] is None  # embeddings and the LM head: AdamW
    assert m["layers"]["norm"]["scale"] is None and m["layers"]["bias"] is None
    assert m["layers"]["query"] == Matrix((0,), (1,), (2, 3))  # embed -> heads x kv
    assert m["layers"]["out"] == Matrix((0,), (1, 2), (3,))  # heads x kv -> embed
    assert m["layers"]["experts"] == Matrix((0, 1), (2,), (3,))  # each expert its own
    split = _matrices(split_heads=True)
    assert split["layers"]["query"] == Matrix((0, 2), (1,), (3,))
    assert split["layers"]["out"] == Matrix((0, 1), (2,), (3,))
    # without logical axes, optax's rule: 2-D leaves are matrices
    assert matrix_of((), (4, 5), None, adamw_params=()) == Matrix((), (0,), (1,))
    assert matrix_of((), (2, 4, 5), None, adamw_params=()) is None


def _reference_updates(grads_seq, params, *, split_heads, lr, wd, beta=0.95):
    """Muon on the matrices and `optax.adamw` on the rest, the matrices in float64."""
    matrices = _matrices(split_heads)
    adamw = optax.adamw(lr, weight_decay=wd)
    adam_state = adamw.init(params)
    momentum = jax.tree.map(lambda p: np.zeros(p.shape), params)
    out = []
    for grads in grads_seq:
        adam_updates, adam_state = adamw.update(grads, adam_state, params)

        def one(g, m_old, p, matrix, adam_u):
            if matrix is None:
                return m_old, np.asarray(adam_u, np.float64)
            m_new = beta * m_old + np.asarray(g, np.float64)
            d = np.asarray(g, np.float64) + beta * m_new
            order = matrix.batch + matrix.reduction + matrix.output
            fan_in, fan_out = matrix.fans(d.shape)
            moved = d.transpose(order)
            stack = moved.reshape(-1, fan_in, fan_out)
            o = np.stack([reference_newton_schulz(s) for s in stack]).reshape(moved.shape)
            o = o.transpose(np.argsort(order)) * 0.2 * math.sqrt(max(fan_in, fan_out))
            return m_new, -lr * (o + wd * np.asarray(p, np.float64))

        pairs = jax.tree.map(one, grads, momentum, params, matrices, adam_updates,
                             is_leaf=lambda x: x is None or isinstance(x, Matrix))
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2  # noqa: E731
        momentum = jax.tree.map(lambda pr: pr[0], pairs, is_leaf=is_pair)
        out.append(jax.tree.map(lambda pr: pr[1], pairs, is_leaf=is_pair))
    return out


@pytest.mark.parametrize("split_heads", [False, True])
def test_update_matches_a_float64_reference(split_heads):
    keys = iter(jax.random.split(jax.random.key(1), 64))
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s), PARAM_SHAPES,
                          is_leaf=lambda x: isinstance(x, tuple))
    grads_seq = [jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
                 for _ in range(2)]
    tx = muon(0.01, weight_decay=0.1, split_heads=split_heads, layout=Layout(LOGICAL))
    state, update = tx.init(params), jax.jit(tx.update)
    want = _reference_updates(grads_seq, params, split_heads=split_heads, lr=0.01, wd=0.1)
    for grads, expected in zip(grads_seq, want):
        got, state = update(grads, state, params)
        rtol = newton_schulz_gain(steps=5) * program_rtol(width=64, depth=15)
        chex.assert_trees_all_close(got, expected, rtol=rtol, atol=rtol * 0.01)
    assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))


def test_owners_take_the_stack_dimension_padded_least():
    assert owner_dim((6,), (1,), 8) == (0, 8)  # 6 layers over 8 owners: 2 idle
    assert owner_dim((2, 4), (1, 1), 4) == (1, 4)  # the heads, not the layers padded 2x
    assert owner_dim((1, 4), (1, 2), 2) == (1, 4)  # 4 experts split 2 ways, then 2 more
    assert owner_dim((1, 4), (1, 2), 4) == (0, 4)  # the split experts are never padded
    assert owner_dim((3,), (3,), 2) is None


def test_config_defaults_are_the_functions():
    config, function = MuonParams(), inspect.signature(muon).parameters
    assert function["beta"].default == config.momentum
    for name in ("nesterov", "ns_steps", "rms_scale", "split_heads", "adamw_params", "placement"):
        assert function[name].default == getattr(config, name), name
    assert function["adamw_betas"].default == tuple(config.betas)
    assert function["adamw_eps"].default == config.eps


def test_example_config_is_muon_with_its_documented_keys():
    config = js.load_config("configs/gpt_muon.yaml")
    assert config.optimizer.type == "Muon" and config.optimizer.params.lr == 6e-3
    assert config.optimizer.params.adamw_params == MuonParams().adamw_params
    assert "configs/gpt_muon.yaml" in open("README.md").read()


def test_config_reports_every_bad_param():
    with pytest.raises(ConfigError) as error:
        js.load_config({"optimizer": {"type": "muon", "params": {
            "momentum": 1.0, "ns_steps": 0, "placement": "everywhere", "rms_scal": 0.2,
            "cluster": ""}}})
    message = str(error.value)
    for key in ("momentum", "ns_steps", "placement", "rms_scal", "cluster"):
        assert f"optimizer.params.{key}" in message, (key, message)
    with pytest.raises(ConfigError, match=r"optimizer.params.cluster: unknown cluster preset"):
        js.initialize(config("optimizer.params.cluster=8xh100"))


# ------------------------------------------------------------------------ the engine, 8 devices

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
    "model.d_ff=128", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
    "optimizer.type=Muon", "optimizer.params.lr=0.003", "optimizer.params.weight_decay=0.1",
    "train_batch_size=16",
]
LR, STEPS, BATCH = 0.003, 2, 16
RHO = gpt_rtol(tokens=BATCH * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset.from_config(config().data, seed=0)


def _batches(dataset):
    return [dataset.batch(i, global_batch=BATCH) for i in range(STEPS)]


@pytest.fixture(scope="module")
def params0():
    """The initial params (key 0) on the host, drawn once by the data8 engine: the other dense
    engines start from them (`init(params=...)`: a program of optimizer zeros, not another
    compile of the model's init), the single-device reference too."""
    engine = js.initialize(config("mesh.data=8"))
    return engine, jax.device_get(engine.init(jax.random.key(0)).params)


@pytest.fixture(scope="module")
def single_device(dataset, params0):
    """Plain optax on one device: the model, `lm_loss` and `muon` with the model's logical axes
    (no mesh), from the engine's initial params."""
    engine, params = params0
    params = jax.device_put(params, jax.devices()[0])
    model = build_gpt(engine.config.model)
    layout = layout_of(engine.plan, placed=False)
    tx = muon(LR, weight_decay=0.1, layout=layout)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss_of = lambda p: lm_loss(model.apply({"params": p}, batch["inputs"]), batch)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, momenta = [], [_momentum(opt_state)]
    for batch in _batches(dataset):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        momenta.append(_momentum(opt_state))
    return _reference(losses, params, layout, momenta)


@pytest.fixture(scope="module")
def dense_moe(dataset):
    """The MoE GPT on 8 devices with every expert on each (no expert axis, no ZeRO): each
    matrix whole where it is, as on one device. No token is dropped (capacity 4) and the
    routing has no noise, so an expert-parallel mesh computes the same. `_reference`'s fields
    and, last, the initial params (on the host) the MoE cases start from."""
    engine = js.initialize(config(*MOE))
    state = engine.init(jax.random.key(0))
    params = jax.device_get(state.params)
    losses, momenta = [], [_momentum(state.opt_state)]
    for batch in _batches(dataset):
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        momenta.append(_momentum(state.opt_state))
    return (*_reference(losses, state.params, layout_of(engine.plan, placed=False), momenta),
            params)


def _reference(losses, params, layout, momenta):
    """What a run is compared with: its losses, params, the params' logical axes, and the
    Newton–Schulz gain of each Muon leaf's directions (`_gain`)."""
    gains = jax.tree_util.tree_map_with_path(
        lambda path, names, *m: _gain(path, names, m), layout.logical_axes, *momenta,
        is_leaf=lambda x: x is None or isinstance(x, tuple))
    return np.array(losses), jax.device_get(params), layout.logical_axes, gains


def _momentum(opt_state):
    """The Muon leaves' momentum (float64, None for AdamW's leaves) of the engine's state."""
    muon_state = opt_state.inner_states["muon"].inner_state[0]
    return jax.tree.map(
        lambda m: None if isinstance(m, optax.MaskedNode) else np.asarray(m, np.float64),
        muon_state.momentum, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def _gain(path, names, momenta, beta=0.95):
    """`newton_schulz_gain` of the Nesterov direction `(1 + beta) m_t - beta m_(t-1)` that each
    step orthogonalized, the largest over steps and stacked matrices (None: not a matrix)."""
    if momenta[0] is None:
        return None
    matrix = matrix_of(path, momenta[0].shape, names)
    order = matrix.batch + matrix.reduction + matrix.output
    gains = []
    for old, new in zip(momenta, momenta[1:]):
        d = ((1 + beta) * new - beta * old).transpose(order)
        for m in d.reshape(-1, *matrix.fans(new.shape)):
            gains.append(newton_schulz_gain(np.linalg.svd(m, compute_uv=False)))
    return max(gains)


def _assert_close_to_reference(state, losses, reference):
    np.testing.assert_allclose(losses, reference[0], rtol=RHO)
    _assert_params_close(state, reference)


def _assert_params_close(state, reference):
    _, want, logical_axes, gains = reference[:4]

    def check(path, got, expected, names):
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        matrix = matrix_of(path, expected.shape, names)
        if matrix is None:
            bound = adam_params_atol(steps=STEPS, lr=LR, rho=RHO, size=expected.size)
        else:
            fan_in, fan_out = matrix.fans(expected.shape)
            bound = muon_params_atol(
                steps=STEPS, lr=LR, rho=RHO, stack=expected.size // (fan_in * fan_out),
                fan_in=fan_in, fan_out=fan_out, gain=_leaf(gains, path))
        err = float(np.linalg.norm(got - expected))
        assert err <= bound, f"{jax.tree_util.keystr(path)}: {err:.3g} > {bound:.3g}"

    jax.tree_util.tree_map_with_path(
        check, jax.device_get(state.params), want, logical_axes,
        is_leaf=lambda x: isinstance(x, np.ndarray))


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def _run(engine, state, batches):
    losses = []
    for batch in batches:
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


MOE = ["model.moe={num_experts: 4, k: 2, every_n_layers: 2, capacity_factor: 4.0, "
       "use_rts: false}", "mesh.data=8"]
CASES = {
    # the 8 [64, 64] projections of 2 layers fill 8 owners; the 4 MLP matrices pad to 8
    "zero3_owner": ["mesh.data=8", "zero_optimization.stage=3",
                    "optimizer.params.placement=owner"],
    "zero3_sharded": ["mesh.data=8", "zero_optimization.stage=3",
                      "optimizer.params.placement=sharded"],
    "zero3_explicit": ["mesh.data=8", "zero_optimization.stage=3",
                       "zero_optimization.collectives=explicit"],
    "pipe2": ["mesh.data=4", "mesh.pipe=2", "zero_optimization.stage=1",
              "pipeline.num_microbatches=2"],
    "offload_optimizer_host": ["mesh.data=8", "zero_optimization.stage=2",
                               "zero_optimization.offload_optimizer.device=cpu",
                               "zero_optimization.offload_optimizer.update_on=host"],
    "moe_expert2_zero3_owner": [*MOE, "mesh.data=4", "mesh.expert=2", "zero_optimization.stage=3",
                                "optimizer.params.placement=owner"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_single_device(request, dataset, params0, case):
    """Each mesh, stage and offload against one device (MoE: against `dense_moe`), from the
    reference's initial params (the pipeline draws its own: its layers are stacked by stage)."""
    moe = case.startswith("moe")
    reference = request.getfixturevalue("dense_moe" if moe else "single_device")
    engine = js.initialize(config(*CASES[case]))
    params = reference[-1] if moe else params0[1]
    state = engine.init(jax.random.key(0), params=None if case == "pipe2" else params)
    state, losses = _run(engine, state, _batches(dataset))
    _assert_close_to_reference(state, losses, reference)


def test_the_comparison_tells_other_matrices_apart(dataset, params0, single_device):
    """Each head its own matrix is another optimizer: the comparison above must see it."""
    engine = js.initialize(config("mesh.data=8", "optimizer.params.split_heads=true"))
    state = engine.init(jax.random.key(0), params=params0[1])
    state, losses = _run(engine, state, _batches(dataset))
    with pytest.raises(AssertionError, match=r"\['attn'\]"):
        _assert_params_close(state, single_device)


#: The parallel test grid (`test_engine`'s meshes and ZeRO stages), in a ring. Each runs the
#: first step from init and saves; the next restores that checkpoint (another mesh or stage) and
#: runs the second step, so every entry also restores Muon's state resharded. Every stage and
#: both meshes, and on each mesh both of Muon's layouts: stage 0 (its matrices whole on data8,
#: split by the tensor axis alone on data4_tensor2) and a sharded optimizer state (pooled over
#: data; over data beside tensor). Left out as the same Muon layout and step as a kept entry:
#: data8 stage 1 (its optimizer state is stage 2's; stage 1's step: data4_tensor2's), data8
#: stage 3 (`CASES`' three zero3 runs: `auto` places as `owner` there), data4_tensor2 stage 2
#: (data8's) and "3/layer" (data8's; data4_tensor2 stage 3's layout).
GRID = [("data8", 0), ("data8", 2), ("data8", "3/layer"),
        ("data4_tensor2", 0), ("data4_tensor2", 1), ("data4_tensor2", 3)]
assert {mesh for mesh, _ in GRID} == set(MESHES) and {s for _, s in GRID} == set(STAGES)


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory, dataset, params0):
    """`{entry: (engine, restored state, state after step 2, [loss 1, loss 2])}`: loss 1 from
    the entry before it in `GRID`, whose checkpoint the entry restored."""
    batches, root = _batches(dataset), tmp_path_factory.mktemp("muon_grid")
    engines = {entry: js.initialize(config(*MESHES[entry[0]], *STAGE_OVERRIDES[entry[1]]))
               for entry in GRID}
    first = engines[GRID[0]]  # the initial state, saved once: a restore is cheaper than an init
    first.save(first.init(jax.random.key(0), params=params0[1]), directory=root / "init")
    first.checkpointer(root / "init").wait()
    first_losses = {}
    for i, (entry, engine) in enumerate(engines.items()):
        state, first_losses[entry] = _run(engine, engine.restore(directory=root / "init"),
                                          batches[:1])
        engine.save(state, directory=root / str(i))
        engine.checkpointer(root / str(i)).wait()
    runs = {}
    for i, (entry, engine) in enumerate(engines.items()):
        restored = engine.restore(directory=root / str(i - 1 if i else len(GRID) - 1))
        state, second = _run(engine, restored, batches[1:])
        runs[entry] = engine, restored, state, first_losses[GRID[i - 1]] + second
    return runs


@pytest.mark.parametrize("entry", GRID, ids=[f"{m}-{s}" for m, s in GRID])
def test_grid_matches_single_device_through_a_reshard(grid_runs, single_device, entry):
    """Two steps on each mesh and stage of the grid, the state resharded through a checkpoint
    in between (saved on the entry before): the restored state lives where this entry's plan
    puts it, and the run equals single-device Muon."""
    engine, restored, state, losses = grid_runs[entry]
    for array, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(engine.state_shardings)):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)
    _assert_close_to_reference(state, losses, single_device)


def test_placement_shows_in_the_compiled_step():
    """ZeRO-3 over 8 devices splits each 64-row matrix into 8-row blocks. `owner` gives each
    device whole matrices to iterate on, with no collective inside the iteration; `sharded`
    iterates on the blocks, gathering in every step."""
    def compiled(case):  # the programs `test_engine_matches_single_device` ran
        hlo = _compiled_step(*CASES[case])[1]
        dots = re.findall(r"= f32\[([0-9,]+)\][^ ]* dot\(", hlo)
        return dots, len(re.findall(r" (?:all-gather|all-reduce)\(", hlo))

    owner_dots, owner_collectives = compiled("zero3_owner")
    sharded_dots, sharded_collectives = compiled("zero3_sharded")
    assert "64,64" in owner_dots and not any(",8,64" in d or ",64,8" in d for d in owner_dots)
    assert any(",8,64" in d or ",64,8" in d for d in sharded_dots)
    assert owner_collectives + 5 * 6 <= sharded_collectives  # >= 5 steps x 6 matrices fewer


@functools.cache
def _compiled_step(*overrides):
    """The engine of `overrides` and its compiled train step's HLO text, once per module (the
    placement, byte model and `auto` tests read the same programs)."""
    engine = js.initialize(config(*overrides))
    return engine, engine.compile_train_step().as_text()


def _owner_moves(*overrides):
    """The bytes the compiled step of `overrides` moves in all-to-alls beyond the same step's
    with `sharded` placement (the MoE tokens' all-to-alls), and what `step_transfers` (the
    planner) prices as Muon's all-to-all to the owners and back: `(names, bytes)`."""
    def all_to_all(*overrides):
        engine, text = _compiled_step(*overrides)
        ops = hlo.collectives(text, num_devices=8)
        return engine, sum(op.bytes * op.executions for op in ops if op.kind == "all-to-all")

    engine, moved = all_to_all(*overrides)
    # `sharded` reads no cluster's rates (they only choose where `auto` places), so the same
    # step without them, once for all clusters
    sharded = [o for o in overrides
               if not o.startswith(("optimizer.params.placement=", "optimizer.params.cluster="))]
    _, without = all_to_all(*sharded, "optimizer.params.placement=sharded")
    transfers = traffic.step_transfers(engine.config,
                                       from_config(engine.config, dict(engine.mesh.shape)))
    priced = [t for t in transfers if t.kind == "all-to-all"]
    return moved - without, ([t.name for t in priced], sum(t.nbytes * t.count for t in priced))


@pytest.mark.parametrize("case", ["zero3_owner", "moe_expert2_zero3_owner"])
def test_the_byte_model_prices_the_moves_to_the_owners(case):
    """The planner has Muon's all-to-all to the owners and back, the bytes the compiled step
    moves (the stacks are padded to the owners' count)."""
    moved, (names, priced) = _owner_moves(*CASES[case])
    assert names == ["muon.owners"] and priced == moved > 0


def test_seconds_and_the_choice_follow_the_rates():
    """`seconds` by hand for 4 `[64, 128]` matrices padded to 8 owners, and `owner_is_cheaper`:
    the padding rule without rates; an unpadded pool always (the same FLOPs, fewer bytes); a
    padded one by the ratio of FLOP/s to bytes/s, the inter-host link's across hosts."""
    f = newton_schulz_flops(64, 128)
    assert f == 5 * (4 * 64 * 64 * 128 + 2 * 64**3)
    price = dict(count=4, padded=8, owners=8, steps=5, flops=2.0, bandwidth=3.0)
    assert seconds("owner", (64, 128), **price) == pytest.approx(f / 2 + 2 * 4 * 64 * 128 * 7 / 8 / 3)
    assert seconds("sharded", (128, 64), **price) == pytest.approx(
        4 * f / 8 / 2 + 5 * 4 * 2 * 4 * 64 * 64 * 7 / 8 / 3)
    choice = dict(count=4, padded=8, owners=8, steps=5)
    assert owner_is_cheaper((64, 128), **choice, rates=None)
    assert not owner_is_cheaper((64, 128), count=3, padded=8, owners=8, steps=5, rates=None)
    for flops, link in ((1e9, 1e9), (1e15, 1e9), (1e9, 1e15)):
        assert owner_is_cheaper((64, 128), count=8, padded=8, owners=8, steps=5,
                                rates=Rates(flops, link, link))
    # sharded wins when FLOP/s over bytes/s is under 6,553,600 / 516,096 = 12.7
    assert not owner_is_cheaper((64, 128), **choice, rates=Rates(12e9, 1e9, 1e15))
    assert owner_is_cheaper((64, 128), **choice, rates=Rates(13e9, 1e9, 1e15))
    assert owner_is_cheaper((64, 128), **choice, rates=Rates(12e9, 1e9, 1e8), across_hosts=True)


def test_auto_places_each_pool_where_the_clusters_rates_price_it_cheaper(tmp_path):
    """ZeRO-3 over 8, `auto`: at 8xh100-nvlink's rates (about 550 FLOPs per byte of link) both
    pools of the tiny GPT go whole to their owners, as with `owner`. On a cluster of 1 GFLOP/s
    and 1 GB/s the MLP pool (4 matrices padded to 8) iterates where it is, and only the 8
    attention projections move. The compiled step's all-to-alls and the planner agree on each."""
    preset = load_cluster("8xh100-nvlink")
    slow = save_cluster(preset.model_copy(update={
        "peak_tflops": PeakTflops(bf16=0.002, fp32=0.002), "intra_host": Link(bandwidth_gbps=1.0),
    }), tmp_path / "slow.yaml")
    zero3 = CASES["zero3_owner"][:2]
    owner, _ = _owner_moves(*CASES["zero3_owner"])
    fast, (_, fast_priced) = _owner_moves(*zero3, "optimizer.params.cluster=8xh100-nvlink")
    moved, (_, priced) = _owner_moves(*zero3, f"optimizer.params.cluster={slow}")
    assert fast == fast_priced == owner
    attention = 2 * 4 * 64 * 64  # a device's one fp32 [64, 64] matrix, there and back
    assert moved == priced == attention < owner


def test_the_planner_counts_newton_schulz_flops():
    """The estimate's FLOPs grow by the iteration's (`muon_cost`): ZeRO-3 over 8 spreads the
    6 layers' matrices over 8 owners, pooled by shape: the 24 `[256, 256]` projections 3 each,
    the 12 `[256, 1024]` MLP matrices padded to 16, 2 each; ZeRO-0 iterates on all of them."""
    from jaxspeed.autoplan.estimate import estimate
    from jaxspeed.config.cluster import load_cluster

    cluster = load_cluster("8xh100-nvlink")
    base = js.load_config("configs/gpt_tiny.yaml", overrides=["mesh.data=8"])
    muon_cfg = js.load_config(base, overrides=["optimizer.type=Muon"])
    square, mlp = newton_schulz_flops(256, 256), newton_schulz_flops(256, 1024)
    for stage, (squares, mlps) in ((3, (3, 2)), (0, (24, 12))):
        plan = from_config(js.load_config(base, overrides=[f"zero_optimization.stage={stage}"]),
                           {"data": 8})
        extra = estimate(muon_cfg, plan, cluster).flops - estimate(base, plan, cluster).flops
        assert extra == pytest.approx(squares * square + mlps * mlp)


def test_adamw_lr_follows_the_schedule():
    """`adamw_lr` is AdamW's peak: the scheduler scales it as it scales `lr` (AdamW's update is
    linear in its lr, so twice the peak is twice the update at every step)."""
    from jaxspeed.optim import build_optimizer

    def adamw_updates(**params):
        cfg = js.load_config({"optimizer": {"type": "Muon", "params": {"lr": 0.01, **params}},
                              "scheduler": {"type": "WarmupLR", "params": {
                                  "warmup_num_steps": 4, "warmup_type": "linear"}}})
        tx, _ = build_optimizer(cfg)
        params_ = {"embedding": jnp.ones((8, 4)), "w": jnp.ones((4, 4))}
        state, out = tx.init(params_), []
        for _ in range(3):
            updates, state = tx.update(jax.tree.map(jnp.ones_like, params_), state, params_)
            out.append(float(updates["embedding"][0, 0]))
        return np.array(out)

    np.testing.assert_allclose(adamw_updates(adamw_lr=0.02), 2 * adamw_updates(), rtol=1e-6)
