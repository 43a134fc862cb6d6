"""`spmd_pipeline`: pipeline parallelism as one SPMD program over the `pipe` mesh axis.

This module owns the public entry point: it validates the arguments, splits the batch into
microbatches, builds the `ExecutionPlan`s of the schedule and chooses how gradients come,
and leaves running a plan to the schedule interpreter (`interpreter.py`: a `lax.scan` under
`jax.shard_map`, manual over `pipe` only). Gradients come one of two ways:
- autodiff through the forward-only loop: `gpipe`, and `1f1b` / `interleaved` when no
  `loss_fn` is given (a backward can only start once its microbatch's loss cotangent exists,
  so without the loss inside the pipeline there is nothing to interleave);
- with a `loss_fn` and `1f1b` / `interleaved`, a `jax.custom_vjp` around the whole pipeline
  whose forward pass, when differentiated, runs the F/B schedule itself: each microbatch's
  loss and its cotangent are taken at the last stage, each microbatch's stage input waits
  in a ring buffer of `plan.res_slots` entries (<= S for 1F1B) until its backward, which
  recomputes the stage under `jax.vjp` (one stage remat), and the parameter and input
  cotangents are accumulated. Peak activation memory is bounded by S, not by M.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxspeed.pipeline.interpreter import LossFn, PyTree, StageFn, run_plan
from jaxspeed.pipeline.schedules import check_schedule_args, execution_plan, schedule_table


# --- Microbatches and argument checks. ------------------------------------------------------


def _split_microbatches(tree: PyTree, m: int) -> PyTree:
    """[batch, ...] -> [m, batch // m, ...]; microbatch i holds rows i, i+m, ... so that a
    batch dimension sharded in blocks over `data` stays sharded without communication."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1), tree)


def _merge_microbatches(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[2:]), tree)


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
    # slices, not shapes: inside another `shard_map` (explicit ZeRO-3's) they keep the axes
    # they vary over, which a scan's carry must match
    one_stage = jax.tree.map(lambda a: a[0], stage_params)
    x = jax.tree.map(lambda a: a[: a.shape[0] // m], inputs)
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
    # inside another `shard_map` (explicit ZeRO-3's) GPipe runs its F/B table too: autodiff
    # through the nested map fails to lower on jax 0.12 (Shardy refuses the saved values'
    # specs, which name the outer map's manual axes)
    nested = bool(jax.sharding.get_abstract_mesh().manual_axes)
    interleave_fb = loss_fn is not None and (schedule != "gpipe" or nested)
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
        run = run_plan(stage_fn, None, forward_plan, mesh=mesh, axis=axis, mode="outputs")
        return _merge_microbatches(run(staged, x, None, None))
    forward_loss = run_plan(stage_fn, loss_fn, forward_plan, mesh=mesh, axis=axis, mode="loss")
    if not interleave_fb:
        return forward_loss(staged, x, loss_params, extra)
    train_table = schedule_table(schedule, stages, m, virtual_stages=v)
    train_plan = execution_plan(train_table, stages=stages, virtual_stages=v)
    train = run_plan(stage_fn, loss_fn, train_plan, mesh=mesh, axis=axis, mode="train")
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
