"""The schedule interpreter: one device's program for an `ExecutionPlan`, run under `shard_map`.

`jax.shard_map` is manual over `pipe` only, so the other mesh axes stay Auto and tensor /
data / ZeRO shardings keep working inside a stage. A `lax.scan` runs the time steps of an
`ExecutionPlan` (the schedule table as integer arrays): at each step every device looks up
its own instruction (forward, backward or idle) and runs it; then activations move one stage
on and cotangents one stage back with `lax.ppermute`. Three modes: "outputs" and "loss" run
the forward-only plan and are differentiated by autodiff through the scan, where every device
evaluates its stage (and the loss) at every step, idle slots included, and masks the result:
kept out of a `lax.switch`, the weight-only residuals are loop-invariant and not stacked once
per step (see `_pipeline_body`); the cost is the stage run on the bubble slots, where the
device would otherwise wait. "train" runs the F/B plan itself and returns the loss with its
cotangents, for the `custom_vjp` of `spmd.py`. This module also owns the small pytree helpers
the loop uses (ring-buffer reads and writes, varying casts, fp32 psums).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxspeed.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    FORWARD_LAST,
    IDLE,
    ExecutionPlan,
)
from jaxspeed.sharding.vma import make_varying, narrow_float

PyTree = Any
StageFn = Callable[[PyTree, PyTree], PyTree]
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


# --- Small pytree helpers. ------------------------------------------------------------------


def _wide_psum(a, axis: str):
    """`lax.psum`, in fp32 for 16-bit floats: more accurate, and XLA:CPU's all-reduce
    promotion pass aborts the process on a bf16 psum whose reducer carries the mesh's sharding
    annotation (jax 0.12, "Invalid binary instruction opcode copy", default optimisation
    level; `make_varying`)."""
    if narrow_float(a):
        return lax.psum(a.astype(jnp.float32), axis).astype(a.dtype)
    return lax.psum(a, axis)


def _varying(tree: PyTree) -> PyTree:
    """Marks every leaf as varying over the manual axes of size > 1: `pipe`, and those of an
    enclosing `shard_map` (explicit ZeRO-3's, whose params vary over these only) where there
    is one (scan carries inside shard_map need it).

    Under autodiff the cast transposes to a psum over the axes it adds, in fp32 for a 16-bit
    leaf (`make_varying`).
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in mesh.manual_axes if mesh.shape[a] > 1)
    return jax.tree.map(lambda a: make_varying(a, axes), tree)


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
        # Cast the pipe-replicated operands to varying here, once: under autodiff the cast
        # transposes to a psum, which must not land inside a per-device `lax.switch` branch.
        inputs, loss_params, loss_inputs = _varying((inputs, loss_params, loss_inputs))
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
        carry = _varying(carry)

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
                return _varying((y, loss, dlp, dy, dp, dx))

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


def run_plan(stage_fn, loss_fn, plan, *, mesh, axis, mode):
    """shard_map of `_pipeline_body`: manual over `axis` only, the other axes stay Auto.
    Inside another `shard_map` (explicit ZeRO-3's, manual over the data-parallel axes) it
    nests in that map's mesh."""
    out_specs = {"outputs": P(), "loss": P(), "train": (P(), P(None, axis), P(), P())}[mode]
    context = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
        _pipeline_body(stage_fn, loss_fn, plan, axis=axis, mode=mode),
        mesh=context if context.manual_axes else mesh,
        in_specs=(P(None, axis), P(), P(), P()),
        out_specs=out_specs,
        axis_names={axis},
    )
