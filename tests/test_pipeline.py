"""Tests for the pipeline schedules (tables) and the SPMD pipeline (jaxspeed/pipeline)."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.pipeline.schedules import (
    Instruction,
    bubble_fraction,
    execution_plan,
    format_table,
    schedule_table,
)
from jaxspeed.pipeline.spmd import spmd_pipeline
from numerics import assert_close, program_rtol



def F(microbatch, chunk=0):  # noqa: N802 (reads like the tables in the papers)
    return Instruction("F", microbatch, chunk)


def B(microbatch, chunk=0):  # noqa: N802
    return Instruction("B", microbatch, chunk)


# --- Schedule tables. -----------------------------------------------------------------------


def test_gpipe_table_is_textbook():
    assert schedule_table("gpipe", 2, 2) == (
        (F(0), None),
        (F(1), F(0)),
        (None, F(1)),
        (None, B(0)),
        (B(0), B(1)),
        (B(1), None),
    )


def test_1f1b_table_is_textbook():
    # PipeDream-Flush: stage 0 warms up with S-1 = 1 forward, then alternates F and B.
    table = schedule_table("1f1b", 2, 3)
    assert [row[0] for row in table] == [F(0), F(1), None, B(0), F(2), B(1), None, B(2)]
    assert [row[1] for row in table] == [None, F(0), B(0), F(1), B(1), F(2), B(2), None]
    assert format_table(table).splitlines()[1] == " . F0 B0 F1 B1 F2 B2  ."


def test_interleaved_table_groups_microbatches_by_stages():
    table = schedule_table("interleaved", 2, 2, virtual_stages=2, forward_only=True)
    assert table == (
        (F(0), None),
        (F(1), F(0)),
        (F(0, 1), F(1)),
        (F(1, 1), F(0, 1)),
        (None, F(1, 1)),
    )


CASES = [("gpipe", s, m, 1) for s, m in [(2, 2), (4, 4), (4, 8), (3, 7), (8, 32)]]
CASES += [("1f1b", s, m, 1) for s, m in [(2, 2), (4, 4), (4, 8), (3, 7), (8, 32)]]
CASES += [("interleaved", s, m, v) for s, m, v in [(2, 2, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2)]]


@pytest.mark.parametrize("schedule,stages,microbatches,v", CASES)
def test_tables_have_textbook_bubble(schedule, stages, microbatches, v):
    expected = (stages - 1) / (v * microbatches + stages - 1)
    for forward_only in (False, True):
        table = schedule_table(
            schedule, stages, microbatches, virtual_stages=v, forward_only=forward_only
        )
        assert bubble_fraction(table) == pytest.approx(expected)


@pytest.mark.parametrize("schedule,stages,microbatches,v", CASES)
def test_tables_run_every_instruction_once_after_its_inputs(schedule, stages, microbatches, v):
    table = schedule_table(schedule, stages, microbatches, virtual_stages=v)
    when = {}
    for t, row in enumerate(table):
        for d, ins in enumerate(row):
            if ins is not None:
                assert (ins, d) not in when
                when[(ins, d)] = t
    assert len(when) == 2 * stages * v * microbatches
    last = stages * v - 1
    for (ins, d), t in when.items():
        j = ins.chunk * stages + d  # virtual stage
        if ins.kind == "F" and j > 0:
            assert when[(F(ins.microbatch, (j - 1) // stages), (j - 1) % stages)] < t
        if ins.kind == "B":
            src = (F(ins.microbatch, ins.chunk), d) if j == last else (
                B(ins.microbatch, (j + 1) // stages), (j + 1) % stages
            )
            assert when[src] < t


def test_1f1b_keeps_at_most_stages_microbatches_in_flight():
    for stages, microbatches in [(2, 2), (4, 16), (4, 64), (8, 32)]:
        plan = execution_plan(schedule_table("1f1b", stages, microbatches), stages=stages)
        assert plan.res_slots == stages
        gpipe = execution_plan(schedule_table("gpipe", stages, microbatches), stages=stages)
        assert gpipe.res_slots == microbatches
    sizes = {
        m: execution_plan(
            schedule_table("interleaved", 4, m, virtual_stages=2), stages=4, virtual_stages=2
        ).res_slots
        for m in (8, 32)
    }
    assert sizes[8] == sizes[32] <= 2 * 4 + 4  # Megatron's warm-up + 1, not M-dependent


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("zb", 2, 4), {}, "schedule='zb' is not supported"),
        (("1f1b", 4, 2), {}, "microbatches >= stages"),
        (("interleaved", 4, 6), {"virtual_stages": 2}, "divisible by stages"),
        (("gpipe", 2, 4), {"virtual_stages": 2}, "needs schedule='interleaved'"),
        (("gpipe", 0, 4), {}, "stages=0 must be a positive integer"),
    ],
)
def test_schedule_errors_name_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        schedule_table(*args, **kwargs)


# --- The SPMD pipeline against the sequential stages. ---------------------------------------

D, H = 8, 16  # width, hidden width
#: Rows of every problem compared with the sequential model, split into 2 to 32 microbatches:
#: one batch size, so the eager reference's kernels compile once for all of them.
BATCH = 32
ROWS = 4  # rows per microbatch where memory is compared across microbatch counts
#: Pipelined vs sequential (tests/numerics.py): sums over up to BATCH rows (weight gradients),
#: chained through up to 8 stages of 2 matmuls, the loss, and the backward's two products each.
RTOL = program_rtol(width=BATCH, depth=3 * (2 * 8 + 2))


def _mesh(pipe, *others):
    names = ("pipe", "data", "tensor")[: 1 + len(others)]
    return jax.make_mesh((pipe, *others), names, axis_types=(AxisType.Auto,) * len(names))


def _stage(p, x):
    """A 2-layer MLP block on a pytree activation {"h": [rows, D], "s": [rows]}."""
    hidden = jnp.tanh(x["h"] @ p["w1"] + p["b1"])
    h = x["h"] + hidden @ p["w2"]
    return {"h": h, "s": x["s"] + jnp.mean(jnp.tanh(h), axis=-1)}


def _loss(head, y, targets):
    return jnp.mean((y["h"] @ head - targets) ** 2) + jnp.mean(y["s"])


def _problem(num_stages, batch, seed=0):
    """Stage params, inputs, loss head and targets, as numpy arrays (numpy RNG, and no
    conversion kernels to compile: jit takes them as they are)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    params = {
        "w1": normal(num_stages, D, H, scale=D**-0.5),
        "b1": normal(num_stages, H, scale=0.1),
        "w2": normal(num_stages, H, D, scale=0.5 * H**-0.5),
    }
    x = {"h": normal(batch, D), "s": normal(batch)}
    return params, x, normal(D, 3, scale=D**-0.5), normal(batch, 3)


def _sequential(stages, x):
    """The un-pipelined model: stage 0, then stage 1, ... on the whole batch."""
    for p in stages:
        x = _stage(p, x)
    return x


def _per_stage(params):
    """[S, ...] stacked numpy params -> a list of S per-stage dicts."""
    return [{k: a[j] for k, a in params.items()} for j in range(len(params["w1"]))]


def _stacked(stages):
    return jax.tree.map(lambda *a: np.stack(a), *stages)


def _project(y, proj):
    return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(proj)))


# The references run eagerly, one small kernel per op: those compile once per shape and serve
# every stage count, where one jitted reference per case cost as much to compile as a third of
# the pipeline itself. Gradients are taken per stage and stacked like the pipeline's.


def _reference_outputs(params, x, proj):
    """(projection of the sequential outputs, outputs), grads wrt params and inputs."""

    def f(stages, x):
        y = _sequential(stages, x)
        return _project(y, proj), y

    (value, y), (dstages, dx) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        _per_stage(params), x)
    return (value, y), (_stacked(dstages), dx)


def _reference_loss(params, x, head, targets):
    """The sequential loss, and its grads wrt params, inputs and head."""

    def f(stages, x, head):
        return _loss(head, _sequential(stages, x), targets)

    loss, (dstages, dx, dhead) = jax.value_and_grad(f, argnums=(0, 1, 2))(
        _per_stage(params), x, head)
    return loss, (_stacked(dstages), dx, dhead)


def _check_outputs_and_grads(schedule, pipe, microbatches, v=1):
    """Outputs mode (autodiff through the forward schedule)."""
    mesh = _mesh(pipe, 8 // pipe)
    params, x, _, _ = _problem(pipe * v, BATCH)
    proj = jax.tree.map(
        lambda a: (np.cos(np.arange(a.size)).reshape(a.shape) / a.shape[0]).astype(np.float32), x)

    def f(params, x):
        y = spmd_pipeline(
            _stage, params, x, num_microbatches=microbatches, schedule=schedule, mesh=mesh,
            virtual_stages=v,
        )
        return _project(y, proj), y

    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    assert_close(got, _reference_outputs(params, x, proj), rtol=RTOL)


@functools.lru_cache(maxsize=None)
def _loss_program(schedule, pipe, microbatches, v, batch):
    """The compiled loss-mode value_and_grad and its arguments (cached: compiling is what
    costs time on CPU, and the memory test reads the same programs; always called with all
    five arguments, so that equal calls share one cache key)."""
    mesh = _mesh(pipe, 8 // pipe)
    params, x, head, targets = _problem(pipe * v, batch, seed=1)

    def piped(params, x, head):
        return spmd_pipeline(
            _stage, params, x, num_microbatches=microbatches, schedule=schedule, mesh=mesh,
            virtual_stages=v, loss_fn=_loss, loss_params=head, loss_inputs=targets,
        )

    step = jax.jit(jax.value_and_grad(piped, argnums=(0, 1, 2)))
    return step.lower(params, x, head).compile(), (params, x, head, targets)


def _check_loss_and_grads(schedule, pipe, microbatches, v=1):
    """Loss mode: for `1f1b` / `interleaved` the F/B-interleaved custom_vjp path."""
    compiled, (params, x, head, targets) = _loss_program(schedule, pipe, microbatches, v, BATCH)
    want = _reference_loss(params, x, head, targets)
    assert_close(compiled(params, x, head), want, rtol=RTOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_loss_and_grads_match_sequential(schedule):
    _check_loss_and_grads(schedule, 2, 8)


def test_1f1b_activation_memory_is_bounded_by_stages():
    def temp_bytes(schedule, microbatches):
        # ROWS per microbatch; at M = 8 that is BATCH rows: the loss tests' programs
        compiled = _loss_program(schedule, 2, microbatches, 1, microbatches * ROWS)[0]
        return compiled.memory_analysis().temp_size_in_bytes

    gpipe, one_f_one_b = temp_bytes("gpipe", 8), temp_bytes("1f1b", 8)  # M = 4S
    twice_the_microbatches = temp_bytes("1f1b", 16)
    assert one_f_one_b < gpipe
    # Only input-sized buffers (the inputs' cotangent) grow with M, not the stage residuals.
    assert twice_the_microbatches < 1.5 * one_f_one_b


SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: Each schedule on all 8 devices (`data` of 1) with as many microbatches as stages (the
#: pipeline never full) and 4 times as many (the steady state dominates), and the interleaved
#: circle of 2 devices at M = S. Each schedule on 2 stages at 4 times is checked elsewhere:
#: gpipe and 1f1b by test_pipeline_loss_and_grads_match_sequential, interleaved (M = 8, v = 2)
#: by test_pipeline_composes_with_tensor_and_data_sharding, which adds shardings. 4 stages, and
#: gpipe / 1f1b at M = S on 2, run the same interpreter code on other tables: the table tests
#: check those tables, and the outputs sweep runs the pipeline on 4.
SWEEP = [
    (schedule, 8, factor * 8, 2 if schedule == "interleaved" else 1)
    for schedule, factor in itertools.product(SCHEDULES, (1, 4))
] + [("interleaved", 2, 2, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,pipe,microbatches,v", SWEEP)
def test_pipeline_loss_sweep_matches_sequential(schedule, pipe, microbatches, v):
    _check_loss_and_grads(schedule, pipe, microbatches, v)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,pipe,microbatches,v",
    # Without a loss_fn, 1f1b is differentiated like GPipe through the same forward-only
    # table (schedule_table(..., forward_only=True) is GPipe's), so GPipe's case covers it;
    # interleaved covers the other schedules' dispatch to that path.
    [("gpipe", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 8, 8, 2)],
)
def test_pipeline_outputs_sweep_matches_sequential(schedule, pipe, microbatches, v):
    _check_outputs_and_grads(schedule, pipe, microbatches, v)


def test_pipeline_composes_with_tensor_and_data_sharding():
    """Interleaved (2 stages per device) on pipe=2 x data=2 x tensor=2, with the stage weights
    sharded over `tensor` (and ZeRO-3 style over `data`) and a constraint inside the stage."""
    mesh = _mesh(2, 2, 2)
    microbatches, v = 8, 2
    params, x, head, targets = _problem(2 * v, BATCH, seed=1)
    specs = {
        "w1": P("pipe", "data", "tensor"),
        "b1": P("pipe", "tensor"),
        "w2": P("pipe", "tensor"),
    }
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    batch = NamedSharding(mesh, P("data"))

    def stage(p, x):
        hidden = jnp.tanh(x["h"] @ p["w1"] + p["b1"])
        hidden = jax.lax.with_sharding_constraint(hidden, P("data", "tensor"))
        h = x["h"] + hidden @ p["w2"]
        return {"h": h, "s": x["s"] + jnp.mean(jnp.tanh(h), axis=-1)}

    def piped(params, x, head):
        return spmd_pipeline(
            stage, params, x, num_microbatches=microbatches, schedule="interleaved", mesh=mesh,
            virtual_stages=v, loss_fn=_loss, loss_params=head, loss_inputs=targets,
        )

    with jax.set_mesh(mesh):
        step = jax.jit(
            jax.value_and_grad(piped, argnums=(0, 1, 2)),
            in_shardings=(shardings, batch, None),
            out_shardings=(None, (shardings, batch, None)),
        )
        compiled = step.lower(params, x, head).compile()
        got = compiled(jax.device_put(params, shardings), jax.device_put(x, batch), head)
    want = _reference_loss(params, x, head, targets)
    assert_close(got, want, rtol=RTOL)
    # Tensor-parallel partial sums inside a stage: all-reduces over the pairs {0,1}, {2,3}, ...
    tensor_groups = r"replica_groups=(\{\{0,1\},\{2,3\}|\[4,2\]<=\[8\])"
    assert re.search(r"all-reduce\([^\n]*" + tensor_groups, compiled.as_text())


# --- Errors. --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(num_microbatches=3), "batch size \\[8\\] is not divisible by num_microbatches=3"),
        (dict(schedule="1f1b", num_microbatches=1), "microbatches >= stages"),
        (dict(axis="stage"), "axis='stage' is not a mesh axis"),
        (dict(virtual_stages=2), "needs schedule='interleaved'"),
        (dict(stage_params={"w": jnp.ones((3, 2))}), "leading stage dimension of 2"),
        (dict(stage_fn=lambda p, x: x[:, :1]), "same pytree structure, shapes and dtypes"),
        (dict(loss_inputs=jnp.ones((7, 2))), "loss_inputs: batch size \\[7\\] is not divisible"),
    ],
)
def test_pipeline_errors_name_the_argument(change, match):
    args = dict(
        stage_fn=lambda p, x: x * p["w"],
        stage_params={"w": jnp.ones((2, 2))},
        inputs=jnp.ones((8, 2)),
        num_microbatches=2,
        schedule="gpipe",
        mesh=_mesh(2, 4),
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        spmd_pipeline(args.pop("stage_fn"), args.pop("stage_params"), args.pop("inputs"), **args)
