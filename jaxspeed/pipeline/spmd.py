"""Pipeline parallelism as one SPMD program over the `pipe` mesh axis.

`jax.shard_map` is manual over `pipe` only, so the other mesh axes stay Auto and tensor /
data / ZeRO shardings keep working inside a stage. A `lax.scan` runs the time steps of an
`ExecutionPlan` (the schedule table as integer arrays): at each step every device looks up
its own instruction (forward, backward or idle) and runs it; then activations move one stage
on and cotangents one stage back with `lax.ppermute`.

Gradients come one of two ways:
- autodiff through the forward-only loop: `gpipe`, and `1f1b` / `interleaved` when no
  `loss_fn` is given (a backward can only start once its microbatch's loss cotangent exists,
  so without the loss inside the pipeline there is nothing to interleave);
- with a `loss_fn` and `1f1b` / `interleaved`, a `jax.custom_vjp` around the whole pipeline
  whose forward pass, when differentiated, runs the F/B schedule itself: each microbatch's
  loss and its cotangent are taken at the last stage, each microbatch's stage input waits
  in a ring buffer of `plan.res_slots` entries (<= S for 1F1B) until its backward, which
  recomputes the stage under `jax.vjp` (one stage remat), and the parameter and input
  cotangents are accumulated. Peak activation memory is bounded by S, not by M.

In the autodiff loop every device evaluates its stage (and the loss) at every step, idle
slots included, and masks the result: kept out of a `lax.switch`, the weight-only residuals
are loop-invariant and not stacked once per step (see `_pipeline_body`). The cost is the
stage run on the bubble slots, where the device would otherwise wait.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspeed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    FORWARD_LAST,
    IDLE,
    ExecutionPlan,
    check_schedule_args,
    execution_plan,
    schedule_table,
)

PyTree = Any
StageFn = Callable[[PyTree, PyTree], PyTree]
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


# --- Small pytree helpers. ------------------------------------------------------------------


def _narrow_float(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4


def _wide_psum(a, axis: str):
    """`lax.psum`, in fp32 for 16-bit floats: more accurate, and XLA:CPU's all-reduce
    promotion pass aborts the process on a bf16 psum whose reducer carries the mesh's sharding
    annotation (jax 0.12, "Invalid binary instruction opcode copy", default optimisation
    level)."""
    if _narrow_float(a):
        return lax.psum(a.astype(jnp.float32), axis).astype(a.dtype)
    return lax.psum(a, axis)


def _varying(tree: PyTree, axis: str) -> PyTree:
    """Marks every leaf as varying over `axis` (scan carries inside shard_map need it).

    Under autodiff the cast transposes to a psum over `axis`; a 16-bit leaf is cast through
    fp32 so that this psum sums in fp32 (see `_wide_psum`).
    """

    def cast(a):
        if axis in jax.typeof(a).mat.varying:
            return a
        if _narrow_float(a):
            return lax.pcast(a.astype(jnp.float32), axis, to="varying").astype(a.dtype)
        return lax.pcast(a, axis, to="varying")

    return jax.tree.map(cast, tree)


def _zeros(tree: PyTree, lead: tuple[int, ...] = ()) -> PyTree:
    return jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), tree)


def _index(tree: PyTree, i) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(tree: PyTree, i, value: PyTree) -> PyTree:
    return jax.tree.map(
        lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), tree, value
    )


def _put_if(tree: PyTree, i, value: PyTree, pred) -> PyTree:
    """`tree[i] = value` where `pred`, else unchanged (`i` is clamped to be valid)."""
    i = jnp.maximum(i, 0)
    new = jax.tree.map(lambda v, o: jnp.where(pred, v.astype(o.dtype), o), value, _index(tree, i))
    return _put(tree, i, new)


def _split_microbatches(tree: PyTree, m: int) -> PyTree:
    """[batch, ...] -> [m, batch // m, ...]; microbatch i holds rows i, i+m, ... so that a
    batch dimension sharded in blocks over `data` stays sharded without communication."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1), tree)


def _merge_microbatches(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[2:]), tree)


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


# --- The SPMD loop (runs inside shard_map; one device = one pipeline position). -------------


def _pipeline_body(
    stage_fn: StageFn,
    loss_fn: LossFn | None,
    plan: ExecutionPlan,
    *,
    axis: str,
    mode: str,
) -> Callable:
    """Builds the per-device program for `mode` "outputs", "loss" or "train".

    The returned function takes `(params [v, 1, ...], inputs [M, mb, ...], loss_params,
    loss_inputs [M, mb, ...])` as seen by one device of `axis`.

    Memory layout choices (they decide what XLA keeps per step):
    - "outputs" / "loss" are differentiated by autodiff through the scan. There every device
      runs its stage (and, in "loss" mode, the loss) at every step, idle slots on microbatch
      0 with the result discarded, instead of branching: a residual produced inside a
      `lax.switch` branch is an output of the conditional, so the scan would stack it per
      step, weights included. Unbranched, the weight-only residuals are loop-invariant and
      hoisted out of the scan, and only the activations are stacked.
    - "train" reads its ring buffers before the `lax.switch` and writes them after it, so the
      conditional only sees one microbatch's values and the buffers are updated in place
      (passing them through the branches made XLA double-buffer them).
    """
    stages = plan.kind.shape[1]
    num_mb = int(plan.microbatch.max()) + 1
    circular = plan.chunk.max() > 0
    fwd_perm = [(d, (d + 1) % stages) for d in range(stages if circular else stages - 1)]
    bwd_perm = [((d + 1) % stages, d) for d in range(stages if circular else stages - 1)]
    rows = {name: getattr(plan, name) for name in ExecutionPlan._fields[:10]}

    def body(params, inputs, loss_params, loss_inputs):
        vary = functools.partial(_varying, axis=axis)
        # Cast the pipe-replicated operands to varying here, once: under autodiff the cast
        # transposes to a psum, which must not land inside a per-device `lax.switch` branch.
        inputs, loss_params, loss_inputs = vary((inputs, loss_params, loss_inputs))
        params = jax.tree.map(lambda a: a[:, 0], params)
        v = jax.tree.leaves(params)[0].shape[0]
        device = lax.axis_index(axis)
        x_template = _index(inputs, 0)

        def chunk_params(c):
            return jax.tree.map(lambda a: a[0], params) if v == 1 else _index(params, c)

        def stage_input(c, r):
            # Idle slots read microbatch 0 of the inputs: real data, so the discarded result
            # of an unbranched stage stays finite.
            from_inputs = (r["first"] == 1) | (r["kind"] == IDLE)
            return jax.tree.map(
                lambda a, b: jnp.where(from_inputs, a, b),
                _index(inputs, r["microbatch"]),
                _index(c["act"], jnp.maximum(r["act_read"], 0)),
            )

        carry = {"act": _zeros(x_template, (plan.act_slots,))}
        if mode == "outputs":
            carry["out"] = _zeros(inputs)
        else:
            carry["loss"] = jnp.zeros((), jnp.float32)
        if mode == "train":
            # The stage inputs of the microbatches in flight; see `step_train`.
            carry["saved_x"] = _zeros(x_template, (plan.res_slots,))
            carry["grad"] = _zeros(x_template, (plan.grad_slots,))
            carry["dparams"] = jax.tree.map(
                lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), params
            )
            carry["dinputs"] = _zeros(inputs)
            carry["dloss_params"] = _zeros(loss_params)
        carry = vary(carry)

        def receive(c, r, send_f, send_b):
            recv = lax.ppermute(send_f, axis, fwd_perm)
            c["act"] = _put_if(c["act"], r["act_recv"], recv, r["act_recv"] >= 0)
            if send_b is not None:
                recv = lax.ppermute(send_b, axis, bwd_perm)
                c["grad"] = _put_if(c["grad"], r["grad_recv"], recv, r["grad_recv"] >= 0)
            return c

        def step_forward(c, row):
            """One step of "outputs" / "loss": unbranched (see the docstring)."""
            r = {name: a[device] for name, a in row.items()}
            c = dict(c)
            y = stage_fn(chunk_params(r["chunk"]), stage_input(c, r))
            is_last = r["kind"] == FORWARD_LAST
            if mode == "outputs":
                c["out"] = _put_if(c["out"], r["microbatch"], y, is_last)
            else:
                loss = loss_fn(loss_params, y, _index(loss_inputs, r["microbatch"]))
                loss = jnp.where(is_last, loss.astype(jnp.float32), 0.0)
                c["loss"] = c["loss"] + loss / num_mb
            # The receiver keeps a value only where the plan says so (act_recv >= 0).
            return receive(c, r, y, None), None

        def step_train(c, row):
            """One step of "train": small branch outputs, buffers updated outside the switch.

            A forward keeps only its stage input (in the `saved_x` ring, `plan.res_slots`
            entries: <= S for 1F1B); the backward reruns the stage forward under `jax.vjp`
            and applies the cotangent at once, so the residuals live within one step. This
            uses `jax.vjp` only as documented (call the returned function) instead of
            carrying its closure, whose structure is JAX's private business, across steps.
            Cost: one more stage forward per backward, about a third more stage compute
            (forward + backward ~ 3 forwards). Measured with `benchmarks/pipeline.py`
            (S=4, D=128, CPU, jax 0.12): XLA's cost analysis of the loop body went from
            35.4 to 48.2 MFLOP, yet the 1F1B step at M=32 did not get slower (min of 15:
            324-337 ms before, 257-291 ms after; moving every residual through the ring
            cost as much), and its activation bytes at M=8 fell from 5.63 to 1.18 MiB.
            """
            r = {name: a[device] for name, a in row.items()}
            c = dict(c)
            kind = r["kind"]
            x = stage_input(c, r)
            operands = (
                chunk_params(r["chunk"]),
                x,
                _index(c["saved_x"], jnp.maximum(r["res_slot"], 0)),
                _index(c["grad"], jnp.maximum(r["grad_read"], 0)),
                _index(loss_inputs, r["microbatch"]),
            )
            zero_x = _zeros(x_template)
            zero_loss = jnp.zeros((), jnp.float32)
            zero_dlp = _zeros(loss_params)

            def outputs(p, y=zero_x, loss=zero_loss, dlp=zero_dlp, dy=zero_x, dp=None,
                        dx=zero_x):
                dp = dp if dp is not None else _zeros(p)
                return vary((y, loss, dlp, dy, dp, dx))

            def idle(ops):
                return outputs(ops[0])

            def forward(ops):
                p, x, _, _, _ = ops
                return outputs(p, y=stage_fn(p, x))

            def forward_last(ops):
                p, x, _, _, extra = ops
                y = stage_fn(p, x)
                value_and_grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
                loss, (dlp, dy) = value_and_grad(loss_params, y, extra)
                # The result is the mean over microbatches: d(mean)/d(loss_i) = 1/M.
                per_mb = functools.partial(jax.tree.map, lambda g: g / num_mb)
                return outputs(
                    p, loss=loss.astype(jnp.float32) / num_mb, dlp=per_mb(dlp), dy=per_mb(dy)
                )

            def backward(ops):
                p, _, saved_x, ct, _ = ops
                _, stage_vjp = jax.vjp(stage_fn, p, saved_x)
                dp, dx = stage_vjp(ct)
                return outputs(p, dp=dp, dx=dx)

            y, loss, dlp, dy, dp, dx = lax.switch(
                kind, [idle, forward, forward_last, backward], operands
            )
            is_forward = (kind == FORWARD) | (kind == FORWARD_LAST)
            c["saved_x"] = _put_if(
                c["saved_x"], r["res_slot"], x, is_forward & (r["res_slot"] >= 0)
            )
            c["grad"] = _put_if(c["grad"], r["grad_self"], dy, r["grad_self"] >= 0)
            c["loss"] = c["loss"] + loss
            c["dloss_params"] = jax.tree.map(jnp.add, c["dloss_params"], dlp)
            c["dparams"] = jax.tree.map(
                lambda acc, g: acc.at[r["chunk"]].add(g.astype(acc.dtype)), c["dparams"], dp
            )
            first_backward = (r["first"] == 1) & (kind == BACKWARD)
            c["dinputs"] = _put_if(c["dinputs"], r["microbatch"], dx, first_backward)
            return receive(c, r, y, dx), None

        carry, _ = lax.scan(step_train if mode == "train" else step_forward, carry, rows)

        def from_device(tree, d):
            return jax.tree.map(lambda a: _wide_psum(jnp.where(device == d, a, 0), axis), tree)

        if mode == "outputs":
            return from_device(carry["out"], stages - 1)
        loss = from_device(carry["loss"], stages - 1)
        if mode == "loss":
            return loss
        dparams = jax.tree.map(lambda g, a: g.astype(a.dtype)[:, None], carry["dparams"], params)
        return (
            loss,
            dparams,
            from_device(carry["dloss_params"], stages - 1),
            from_device(carry["dinputs"], 0),
        )

    return body


def _run(stage_fn, loss_fn, plan, *, mesh, axis, mode):
    """shard_map of `_pipeline_body`: manual over `axis` only, the other axes stay Auto."""
    out_specs = {"outputs": P(), "loss": P(), "train": (P(), P(None, axis), P(), P())}[mode]
    return jax.shard_map(
        _pipeline_body(stage_fn, loss_fn, plan, axis=axis, mode=mode),
        mesh=mesh,
        in_specs=(P(None, axis), P(), P(), P()),
        out_specs=out_specs,
        axis_names={axis},
    )


# --- Public entry point. --------------------------------------------------------------------


def _leading_dims(tree: PyTree) -> list[int]:
    return sorted({a.shape[0] if a.ndim else -1 for a in jax.tree.leaves(tree)})


def _validate(stage_fn, stage_params, inputs, loss_inputs, *, m, stages, v, interleave_fb):
    """Raises a `ValueError` naming the argument for inputs the pipeline cannot run."""
    if _leading_dims(stage_params) != [stages * v]:
        raise ValueError(
            f"stage_params: every leaf needs a leading stage dimension of {stages * v} "
            f"(pipe size {stages} x virtual_stages {v}), got {_leading_dims(stage_params)}"
        )
    for name, tree in (("inputs", inputs), ("loss_inputs", loss_inputs)):
        sizes = _leading_dims(tree)
        if tree is not None and (len(sizes) != 1 or sizes[0] < 1 or sizes[0] % m):
            raise ValueError(
                f"{name}: batch size {sizes} is not divisible by num_microbatches={m} "
                "(every leaf needs the same leading batch dimension, a multiple of it)"
            )
    if loss_inputs is not None and _leading_dims(loss_inputs) != _leading_dims(inputs):
        raise ValueError(
            f"loss_inputs: batch size {_leading_dims(loss_inputs)} differs from the inputs' "
            f"{_leading_dims(inputs)}"
        )
    if interleave_fb and not all(
        jnp.issubdtype(a.dtype, jnp.floating) for a in jax.tree.leaves(inputs)
    ):
        raise ValueError(
            "inputs: with a loss_fn, '1f1b' and 'interleaved' need floating-point activation "
            "leaves; pass integer data (token ids, masks) through loss_inputs or stage_params"
        )
    one_stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
    x = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype), inputs
    )
    y = jax.eval_shape(stage_fn, one_stage, x)
    same = jax.tree.structure(y) == jax.tree.structure(x) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(x))
    )
    if not same:
        raise ValueError(
            "stage_fn must return the same pytree structure, shapes and dtypes as its input "
            f"(the next stage's input); got {y} for input {x}"
        )


def spmd_pipeline(
    stage_fn: StageFn,
    stage_params: PyTree,
    inputs: PyTree,
    *,
    num_microbatches: int,
    schedule: str,
    mesh: Mesh,
    axis: str = "pipe",
    virtual_stages: int = 1,
    loss_fn: LossFn | None = None,
    loss_params: PyTree = None,
    loss_inputs: PyTree = None,
) -> PyTree:
    """Runs `stage_fn` as a pipeline over the `axis` devices of `mesh`.

    Equivalent to applying the stages in order, `x = stage_fn(stage_params[j], x)` for
    j = 0 .. S*v-1, to every microbatch; outputs and gradients match that (fp32 rounding).

    Args:
      stage_fn: `(params_of_one_stage, x) -> y`, with `y` of the same pytree structure,
        shapes and dtypes as `x` (`x` is one microbatch, `[batch // M, ...]` leaves). It may
        constrain shardings over the mesh's other (Auto) axes with bare `PartitionSpec`s
        under `jax.set_mesh` (a `NamedSharding` of the full mesh is rejected inside the
        pipe-manual region). Arrays it is differentiated with respect to must come in
        through `stage_params` (`loss_params` for `loss_fn`), not by closure.
      stage_params: pytree, every leaf `[S * v, ...]`: the stacked stage parameters in model
        order. Sharded over `axis` on that dimension (for `v > 1`, stage j runs on device
        j % S, so a `[v, S, ...]`-shaped storage avoids a reshuffle).
      inputs: pytree, every leaf `[batch, ...]`; microbatch i is rows i, i+M, i+2M, ...
      num_microbatches: M; must divide `batch`.
      schedule: "gpipe", "1f1b" or "interleaved" (see `schedules.py`).
      mesh: the device mesh; `axis` must be one of its axes.
      axis: the pipeline mesh axis.
      virtual_stages: v, stages per device (`interleaved` only).
      loss_fn: optional `(loss_params, y, loss_inputs_mb) -> scalar`, applied to each
        microbatch's output at the last stage. Given, the result is the mean of the
        microbatch losses, and `1f1b` / `interleaved` run backwards interleaved with
        forwards (activation memory bounded by S); without it they are differentiated like
        GPipe.
      loss_params: pytree passed to `loss_fn` (e.g. the output head), differentiable.
      loss_inputs: pytree of `[batch, ...]` leaves split like `inputs` (e.g. targets); not
        differentiated (zero cotangent).

    Returns:
      Without `loss_fn`: the outputs, same structure and shapes as `inputs`. With
      `loss_fn`: a float32 scalar, the mean over microbatches of `loss_fn`.

    Raises:
      ValueError: unknown schedule or axis, a batch not divisible by `num_microbatches`,
        stage dimensions not equal to `S * v`, `1f1b` with M < S, `interleaved` with M not
        divisible by S, a `stage_fn` that changes its input's structure or shapes, or
        integer activation leaves with a `loss_fn` under `1f1b` / `interleaved`.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not a mesh axis; the mesh has {mesh.axis_names}")
    stages, v, m = mesh.shape[axis], virtual_stages, num_microbatches
    check_schedule_args(schedule, stages, m, v)
    interleave_fb = loss_fn is not None and schedule != "gpipe"
    _validate(
        stage_fn, stage_params, inputs, loss_inputs, m=m, stages=stages, v=v,
        interleave_fb=interleave_fb,
    )
    # [S*v, ...] in model order -> [v, S, ...]: virtual stage c*S + d is chunk c of device d.
    staged = jax.tree.map(lambda a: a.reshape(v, stages, *a.shape[1:]), stage_params)
    x = _split_microbatches(inputs, m)
    extra = _split_microbatches(loss_inputs, m)
    forward_table = schedule_table(schedule, stages, m, virtual_stages=v, forward_only=True)
    forward_plan = execution_plan(forward_table, stages=stages, virtual_stages=v)
    if loss_fn is None:
        run = _run(stage_fn, None, forward_plan, mesh=mesh, axis=axis, mode="outputs")
        return _merge_microbatches(run(staged, x, None, None))
    forward_loss = _run(stage_fn, loss_fn, forward_plan, mesh=mesh, axis=axis, mode="loss")
    if not interleave_fb:
        return forward_loss(staged, x, loss_params, extra)
    train_table = schedule_table(schedule, stages, m, virtual_stages=v)
    train_plan = execution_plan(train_table, stages=stages, virtual_stages=v)
    train = _run(stage_fn, loss_fn, train_plan, mesh=mesh, axis=axis, mode="train")
    return _interleaved_vjp(forward_loss, train)(staged, x, loss_params, extra)


def _interleaved_vjp(forward_loss: Callable, train: Callable) -> Callable:
    """The loss as a `custom_vjp` whose differentiated forward runs the F/B schedule."""

    @jax.custom_vjp
    def pipelined_loss(staged, x, loss_params, extra):
        return forward_loss(staged, x, loss_params, extra)

    def fwd(staged, x, loss_params, extra):
        loss, dparams, dloss_params, dx = train(staged, x, loss_params, extra)
        return loss, (dparams, dx, dloss_params)

    def bwd(grads, g):
        scaled = jax.tree.map(lambda a: (a * g).astype(a.dtype), grads)
        return (*scaled, None)  # None: zero cotangent for `extra`

    pipelined_loss.defvjp(fwd, bwd)
    return pipelined_loss
