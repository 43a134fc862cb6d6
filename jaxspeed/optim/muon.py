"""Muon (Jordan et al. 2024) with Moonlight's scaling (Liu et al. 2025), for stacked and sharded
weights.

`muon` is an optax `GradientTransformation`. For each weight matrix: Nesterov momentum, then the
momentum orthogonalized by Newton–Schulz steps with the published quintic coefficients, scaled by
`rms_scale · √max(m, n)` (0.2 matches AdamW's update RMS, so AdamW's lr and weight decay carry
over), decoupled weight decay, `-lr`. Every other leaf (embeddings, the LM head, norms, biases)
takes AdamW's update inside the same transformation, with its own lr and weight decay. Its state
is `optax.partition`'s: the matrices' momentum and AdamW's moments, each shaped like its params.

Which axes of a leaf are the matrix comes from its logical axes (Flax partitioning metadata):
`layers` (a scanned stack) and `expert` are batch axes, so each layer and each expert is its own
matrix; `embed` (the residual stream) is one side and the other axes are the other. With
`split_heads`, `heads` is a batch axis too: each head's projection is its own matrix. A leaf
without logical axes is a matrix when it is 2-D (optax's rule).

Where each matrix's Newton–Schulz runs (`Layout`): `sharded` iterates on the momentum where it
lives and lets XLA partition the matmuls (for a matrix split by ZeRO or tensor parallelism, a
collective in every step). `owner` moves the axes that split the matrices onto a stack
dimension, so that each device holds whole matrices, a share of the stack (DistMuon's round
robin, as a sharding), and iterates on them without communication: an all-to-all there and
back. The matrices of every leaf whose stack nothing splits are pooled by shape and layout
(the q, k, v and out projections of every layer are one pool of `[d, d]` matrices), so the
padding to a multiple of the owners is paid once per pool, not per leaf (`Pool`). A stack an
axis splits already (the experts under `expert`) moves onto one of its own dimensions, padded
(`Owners`). `auto` picks, per pool and per leaf, the placement `jaxspeed.optim.muon_price`
prices cheaper at the cluster's rates (without them: `owner` unless the padding would be over
half the owners' work); a leaf whose matrices are whole already iterates where it is.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.config.optimizer import MUON_ADAMW_PARAMS as ADAMW_PARAMS
from jaxspeed.optim.muon_price import Rates, owner_is_cheaper
from jaxspeed.optim.qk_clip import qk_clip as clip_logits
from jaxspeed.runtime.mesh import HOST
from jaxspeed.sharding.leaves import LeafPlan
from jaxspeed.tree_paths import key_names

#: Keller Jordan's quintic Newton–Schulz coefficients (Moonlight and Kimi K2 use them too).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
#: Logical axes that stack independent matrices.
BATCH_AXES = ("layers", "stage", "expert")
Placement = Literal["auto", "owner", "sharded"]
_MUON, _ADAMW = "muon", "adamw"


class Layout(NamedTuple):
    """What `muon` knows of the params beyond their shapes (each field optional).

    Attributes:
      logical_axes: a pytree like the params with a tuple of logical axis names (or None) for
        each leaf.
      opt_specs: a pytree like the params with each leaf's optimizer-state `PartitionSpec`.
      mesh: the mesh of `opt_specs`; without it every matrix runs `sharded`.
    """

    logical_axes: Any = None
    opt_specs: Any = None
    mesh: Mesh | None = None


def layout_of(plan, *, placed: bool = True) -> Layout:
    """The `Layout` of a `jaxspeed.sharding.Plan`; `placed=False` leaves out its mesh (an update
    on the host runs every matrix where it is)."""
    def field(name):
        return jax.tree.map(lambda leaf: getattr(leaf, name), plan.leaves,
                            is_leaf=lambda x: isinstance(x, LeafPlan))

    return Layout(field("logical"), field("opt"), plan.mesh if placed else None)


class Matrix(NamedTuple):
    """How one leaf is a stack of matrices: its batch, reduction and output axes."""

    batch: tuple[int, ...]
    reduction: tuple[int, ...]
    output: tuple[int, ...]

    def fans(self, shape) -> tuple[int, int]:
        return (math.prod(shape[a] for a in self.reduction), math.prod(shape[a] for a in self.output))


class MuonState(NamedTuple):
    """The matrices' momentum (float32, like the params)."""

    momentum: Any


def matrix_of(path, shape, names, *, adamw_params=ADAMW_PARAMS, split_heads=False) -> Matrix | None:
    """The matrix view of one leaf, or None for a leaf that AdamW updates."""
    where = jax.tree_util.keystr(path, simple=True, separator="/")
    if any(fnmatch.fnmatchcase(where, pattern) for pattern in adamw_params):
        return None
    if names is None:
        return Matrix((), (0,), (1,)) if len(shape) == 2 else None
    batch_names = BATCH_AXES + (("heads",) if split_heads else ())
    batch = tuple(i for i, name in enumerate(names) if name in batch_names)
    rest = [i for i in range(len(shape)) if i not in batch]
    if len(rest) < 2:
        return None
    if names[rest[-1]] == "embed" and names[rest[0]] != "embed":  # a projection back to `embed`
        return Matrix(batch, tuple(rest[:-1]), (rest[-1],))
    return Matrix(batch, (rest[0],), tuple(rest[1:]))  # Flax's layout: inputs first


def newton_schulz(x: jax.Array, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-7) -> jax.Array:
    """`x` (`[..., m, n]`) with each matrix's singular values pushed towards 1: about `U Vᵀ`.

    Each step is `a X + (b A + c A²) X` with `A = X Xᵀ`, on the wide orientation, after
    scaling each matrix to unit Frobenius norm.
    """
    a, b, c = coeffs
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _split_axes(spec: P, dims, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split dimensions `dims` of arrays with `spec`."""
    entries = [spec[d] if d < len(spec) else None for d in dims]
    return tuple(axis for entry in entries for axis in _axes(entry) if mesh.shape[axis] > 1)


class Owners(NamedTuple):
    """Where a leaf's matrices go whole: its batch dimension `dim`, padded to `size`, split over
    the devices that split the matrices (`sharding`, the leaf's layout)."""

    dim: int
    size: int
    sharding: NamedSharding


class Pool(NamedTuple):
    """Where the matrices of a stack nothing splits go whole: pooled with every other matrix of
    the same shape and layout, the pool padded to a multiple of the devices that split them
    (the mesh `axes`) and spread over them. `auto`: only where `owner_is_cheaper` at `rates`.

    Attributes:
      flip: the leaf's matrices are transposed into the pool (to be wide; a square one, to be
        split by its columns like the others).
      layout: the mesh axes that split the pooled matrices' rows, and their columns: the
        members of a pool concatenate where they are.
    """

    axes: tuple[str, ...]
    mesh: Mesh
    auto: bool
    flip: bool = False
    layout: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    rates: Rates | None = None


def owner_dim(batch_sizes, batch_splits, owners: int) -> tuple[int, int] | None:
    """The batch dimension of a stack to spread it over `owners` more devices, and its size
    padded to a multiple of its split: the one padded least. A dimension already split is not
    padded (its pieces would not line up); None when none fits."""
    best = None
    for i, (size, split) in enumerate(zip(batch_sizes, batch_splits)):
        unit = split * owners
        padded = -(-size // unit) * unit
        if (split == 1 or padded == size) and (
                best is None or padded * batch_sizes[best[0]] < best[1] * size):
            best = (i, padded)
    return best


def _orthogonalize(x, m: Matrix, *, steps, dtype, owners: Owners | None):
    """Newton–Schulz on each matrix of `x` (its batch axes kept apart, so an existing split of
    them stays), first moved whole onto `owners` when given."""
    count = x.shape[owners.dim] if owners is not None else None
    if owners is not None:
        pad = [(0, 0)] * x.ndim
        pad[owners.dim] = (0, owners.size - count)
        x = jax.lax.with_sharding_constraint(jnp.pad(x, pad), owners.sharding)
    order = m.batch + m.reduction + m.output
    moved = x.transpose(order)
    stack = moved.reshape(*moved.shape[:len(m.batch)], *m.fans(x.shape))
    out = newton_schulz(stack.astype(dtype), steps).astype(x.dtype)
    out = out.reshape(moved.shape).transpose(tuple(order.index(a) for a in range(x.ndim)))
    if owners is not None:
        out = jax.lax.slice_in_dim(out, 0, count, axis=owners.dim)
    return out


def _stacked(x, m: Matrix, flip: bool) -> jax.Array:
    """`x`'s matrices as one stack `[count, fan_in, fan_out]`, transposed with `flip`."""
    stack = x.transpose(m.batch + m.reduction + m.output).reshape(-1, *m.fans(x.shape))
    return stack.mT if flip else stack


def _unstacked(stack, like, m: Matrix, flip: bool) -> jax.Array:
    """`_stacked`'s inverse: `stack` back in the layout of `like`."""
    order = m.batch + m.reduction + m.output
    stack = stack.mT if flip else stack
    moved = stack.reshape(tuple(like.shape[a] for a in order))
    return moved.transpose(tuple(order.index(a) for a in range(like.ndim)))


def _pooled(stacks, pool: Pool, *, steps, dtype) -> list[jax.Array]:
    """Newton–Schulz on every matrix of `stacks` (same `[rows, cols]` and layout), moved whole
    onto the pool's owners first: concatenated, padded to a multiple of the owners and split
    over them."""
    x = jnp.concatenate(stacks)
    count, owners = x.shape[0], math.prod(pool.mesh.shape[a] for a in pool.axes)
    size = -(-count // owners) * owners
    if not pool.auto or owner_is_cheaper(x.shape[1:], count=count, padded=size, owners=owners,
                                         steps=steps, rates=pool.rates,
                                         across_hosts=HOST in pool.axes):
        x = jnp.pad(x, [(0, size - count), (0, 0), (0, 0)])
        x = jax.lax.with_sharding_constraint(x, NamedSharding(pool.mesh, P(pool.axes)))
    out = newton_schulz(x.astype(dtype), steps).astype(x.dtype)
    return jnp.split(out[:count], list(itertools.accumulate(s.shape[0] for s in stacks))[:-1])


def scale_by_muon(
    matrix, *, beta: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_dtype=None,
    rms_scale: float = 0.2, owner=None,
) -> optax.GradientTransformation:
    """Momentum, Newton–Schulz and Moonlight's RMS scaling, for leaves that are all matrices.

    Args:
      matrix: `(key path, shape) -> Matrix`, how each leaf is a stack of matrices.
      beta: the momentum's decay; `nesterov` adds `beta ×` the new momentum to the gradient.
      ns_steps: Newton–Schulz steps.
      ns_dtype: the iteration's dtype (None: bfloat16 on GPU, float32 elsewhere).
      rms_scale: the update is scaled to RMS `rms_scale` (`× √max(fan_in, fan_out)` after
        the orthogonalization, whose RMS is about `1/√max`).
      owner: `(key path, Matrix, shape) -> Owners | Pool | None`, where each leaf's
        Newton–Schulz runs: on its own stack's owners (`_orthogonalize`), pooled with the
        matrices of its shape (`_pooled`), or where its momentum lives (None).
    """
    dtype = ns_dtype or (jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)

    def init(params):
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def orthogonalize(direction):
        leaves, treedef = jax.tree.flatten_with_path(direction)
        views = [matrix(path, x.shape) for path, x in leaves]
        out, pools = [None] * len(leaves), {}
        for i, ((path, x), m) in enumerate(zip(leaves, views)):
            where = owner(path, m, x.shape) if owner else None
            if isinstance(where, Pool):  # with every matrix of its shape and layout
                stack = _stacked(x, m, where.flip)
                key = (stack.shape[1:], where._replace(flip=False))
                pools.setdefault(key, []).append((i, where.flip, stack))
            else:
                out[i] = _orthogonalize(x, m, steps=ns_steps, dtype=dtype, owners=where)
        for (_, pool), members in pools.items():
            done = _pooled([stack for *_, stack in members], pool, steps=ns_steps, dtype=dtype)
            for (i, flip, _), stack in zip(members, done):
                out[i] = _unstacked(stack, leaves[i][1], views[i], flip)
        return treedef.unflatten([y * (rms_scale * math.sqrt(max(m.fans(y.shape))))
                                  for y, m in zip(out, views)])

    def update(updates, state, params=None):
        del params
        momentum = jax.tree.map(lambda m, g: beta * m + g, state.momentum, updates)
        direction = (jax.tree.map(lambda m, g: g + beta * m, momentum, updates) if nesterov
                     else momentum)
        return orthogonalize(direction), MuonState(momentum)

    return optax.GradientTransformation(init, update)


def _by_path(tree, is_leaf) -> dict[tuple[str, ...], Any]:
    return {key_names(path): leaf
            for path, leaf in jax.tree.flatten_with_path(tree, is_leaf=is_leaf)[0]}


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype=None,
    rms_scale: float = 0.2,
    weight_decay: float = 0.0,
    split_heads: bool = False,
    adamw_params: tuple[str, ...] = ADAMW_PARAMS,
    adamw_learning_rate: optax.ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    placement: Placement = "auto",
    rates: Rates | None = None,
    layout: Layout = Layout(),
    qk_clip: float | None = None,
    qk_clip_alpha: float = 0.5,
) -> optax.GradientTransformation:
    """Muon on the weight matrices and AdamW on the rest, as one optax transformation.

    Args:
      learning_rate: Muon's lr (float or schedule); also AdamW's unless `adamw_learning_rate`.
      beta, nesterov, ns_steps, ns_dtype, rms_scale: see `scale_by_muon`.
      weight_decay: Muon's decoupled weight decay (`-lr · wd · p`, as `optax.adamw`).
      split_heads: each attention head's projection is its own matrix (needs logical axes).
      adamw_params: globs of `/`-joined param paths that AdamW updates; leaves that are not
        matrices (fewer than 2 axes besides their stack) always go to AdamW.
      adamw_learning_rate, adamw_betas, adamw_eps: AdamW's (lr defaults to Muon's).
      adamw_weight_decay: AdamW's weight decay (None: `weight_decay`).
      placement: where each matrix's Newton–Schulz runs: `auto`, `owner` or `sharded`.
      rates: what `auto` prices the two with (`jaxspeed.optim.muon_price`; None: the padding
        rule).
      layout: the params' logical axes and optimizer-state shardings (`Layout`).
      qk_clip, qk_clip_alpha: MuonClip: `jaxspeed.optim.qk_clip.qk_clip(qk_clip,
        qk_clip_alpha)` after the update (None: off).

    Returns:
      The `optax.GradientTransformation`; its `update` needs no params for Muon's leaves. With
      `qk_clip` it needs the params and `attn_logit_max=` (`jaxspeed.optim.qk_clip`).
    """
    if ns_steps < 1 or not 0.0 <= beta < 1.0 or rms_scale <= 0:
        raise ValueError(f"muon: need ns_steps >= 1, 0 <= beta < 1 and rms_scale > 0; got "
                         f"ns_steps={ns_steps}, beta={beta}, rms_scale={rms_scale}")
    if placement not in ("auto", "owner", "sharded"):
        raise ValueError(f"muon: placement must be auto, owner or sharded, got {placement!r}")
    is_names = lambda x: x is None or isinstance(x, tuple)  # noqa: E731
    names = {} if layout.logical_axes is None else _by_path(layout.logical_axes, is_names)
    specs = {} if layout.opt_specs is None else _by_path(
        layout.opt_specs, lambda x: isinstance(x, P))

    def matrix(path, shape):
        return matrix_of(path, shape, names.get(key_names(path)), adamw_params=adamw_params,
                         split_heads=split_heads)

    def owner(path, m: Matrix, shape) -> Owners | Pool | None:
        mesh = layout.mesh
        if mesh is None or placement == "sharded":
            return None
        spec = specs.get(key_names(path), P())
        moved = _split_axes(spec, m.reduction + m.output, mesh)
        if not moved:  # whole matrices already: Newton–Schulz runs where they are
            return None
        splits = [math.prod(mesh.shape[a] for a in _split_axes(spec, (d,), mesh)) for d in m.batch]
        rows, cols = (_split_axes(spec, dims, mesh) for dims in (m.reduction, m.output))
        # nothing splits the stack: pool its matrices; not split on both sides (TP beside ZeRO),
        # which XLA's partitioner concatenates only by replicating them
        if all(split == 1 for split in splits) and not (rows and cols):
            fan_in, fan_out = m.fans(shape)
            flip = fan_in > fan_out or (fan_in == fan_out and bool(rows))
            return Pool(moved, mesh, placement == "auto", flip,
                        (cols, rows) if flip else (rows, cols), rates)
        k = math.prod(mesh.shape[a] for a in moved)
        found = owner_dim([shape[d] for d in m.batch], splits, k)
        if found is None:
            return None
        dim = m.batch[found[0]]
        count = math.prod(shape[d] for d in m.batch) // math.prod(splits)
        if placement == "auto" and not owner_is_cheaper(
                m.fans(shape), count=count, padded=count * found[1] // shape[dim], owners=k,
                steps=ns_steps, rates=rates, across_hosts=HOST in moved):
            return None
        entries = [None if d in m.reduction + m.output else (spec[d] if d < len(spec) else None)
                   for d in range(len(shape))]
        entries[dim] = _split_axes(spec, (dim,), mesh) + moved
        return Owners(dim, found[1], NamedSharding(mesh, P(*entries)))

    def labels(params):
        return jax.tree.map_with_path(
            lambda path, p: _ADAMW if matrix(path, p.shape) is None else _MUON, params)

    wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    b1, b2 = adamw_betas
    tx = optax.partition({
        _MUON: optax.chain(
            scale_by_muon(matrix, beta=beta, nesterov=nesterov, ns_steps=ns_steps,
                          ns_dtype=ns_dtype, rms_scale=rms_scale, owner=owner),
            optax.add_decayed_weights(weight_decay),
            optax.scale_by_learning_rate(learning_rate),
        ),
        _ADAMW: optax.adamw(learning_rate if adamw_learning_rate is None else adamw_learning_rate,
                            b1=b1, b2=b2, eps=adamw_eps, weight_decay=wd),
    }, labels)
    return tx if qk_clip is None else optax.chain(tx, clip_logits(qk_clip, qk_clip_alpha))
