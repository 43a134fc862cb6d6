"""`grouped_matmul`: `jax.lax.ragged_dot` as one batched dot over capacity-padded blocks.

Why not `ragged_dot` itself: XLA:CPU runs it at 1-2 GFLOP/s. At benchmarks/moe_dropless.py's
setup (T = 4096, M = 512, E = 64 x 256, top-2, fwd+bwd; jax 0.12, 2 shared cores) the dropless
FFN took 6.0-11.7 s with it and 0.20-0.34 s with this (30-35x), in 296 MiB instead of 3.9 GB.
(jaxspeed's former C++ grouped GEMM was only 1.06-1.31x faster than this, and was removed.)

The rows of each group are gathered into a zero-padded block of `C` rows, `[G, C, K]`,
multiplied by `rhs [G, K, P]` as one batched dot and gathered back. `C` is chosen at run time
(`lax.switch`) from a few static sizes, the smallest that holds the largest group: 1, 1.25,
1.5 or 2 times the mean group size (`CAPACITIES`). A group larger than all of them is split
over several blocks of the smallest size, each block with its group's weights gathered
(`[NB, K, P]`, `NB <= G + N / C`), so any routing works: with one expert taking half the rows
the FFN took about 1.4x its balanced time, in the same memory.

Gradients come from a custom VJP, both grouped products again (`d lhs = g @ rhs[g]^T`,
`d rhs[g] = lhs_g^T @ g_g`, on the same blocks). It also keeps the `lax.switch` out of
autodiff, which would make every branch return the residuals of all the others.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspeed.moe.dispatch import take_rows
from jaxspeed.sharding.vma import vary_alike

#: Block sizes (as multiples of the mean group size `N / G`) to pick from, ascending.
CAPACITIES = (1.0, 1.25, 1.5, 2.0)
_MULTIPLE = 8  # block sizes are rounded up to a multiple of this


def grouped_matmul(lhs, rhs, group_sizes, *, trans_b: bool = False):
    """`out[rows of group g] = lhs[rows of group g] @ op(rhs[g])`, in fp32 (`ragged_dot`).

    Args:
      lhs: `[N, K]`, rows sorted by group: group 0's first, then group 1's, ...
      rhs: `[G, K, P]`, or `[G, P, K]` with `trans_b`.
      group_sizes: int `[G]`, rows per group, summing to at most `N` (the rows after the
        last group come out zero).
      trans_b: use the transpose of each `rhs[g]`.

    Returns:
      fp32 `[N, P]`. Differentiable in reverse mode (to any order); forward mode (`jax.jvp`)
      is not available, as for any `custom_vjp`.
    """
    trans_b = bool(trans_b)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul needs lhs [N, K], rhs [G, ., .] and group_sizes [G], "
                         f"got {lhs.shape}, {rhs.shape} and {group_sizes.shape}")
    if (rhs.shape[2] if trans_b else rhs.shape[1]) != lhs.shape[1]:
        raise ValueError(f"grouped_matmul: contracting sizes differ for lhs {lhs.shape} and "
                         f"rhs {rhs.shape} (trans_b={trans_b})")
    return _grouped(*vary_alike(lhs, rhs, group_sizes.astype(jnp.int32)), trans_b)


class _Blocks(NamedTuple):
    """Where the rows go: `NB` blocks of `C` rows, each holding rows of one group."""

    row: jax.Array  # int32 [NB, C]: the lhs row in each block slot, -1 for padding
    slot: jax.Array  # int32 [N]: the flat block slot (b * C + c) of each row, -1 past the groups
    group: jax.Array | None  # int32 [NB]: each block's group; None when block g is group g


def _blocks(group_sizes, rows: int, capacity: int, num_blocks: int) -> _Blocks:
    """Every group split into `max(ceil(size / C), 1)` consecutive blocks of `C` rows.

    With `num_blocks == G` every group fits one block (the caller checked): block g is group g.
    """
    groups = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    per_group = jnp.maximum(-(-group_sizes // capacity), 1)
    first_block = jnp.cumsum(per_group) - per_group

    row = jnp.arange(rows, dtype=jnp.int32)
    group_of_row = jnp.minimum(_count_at_most(ends, rows), groups - 1)
    local = row - starts[group_of_row]
    slot = (first_block[group_of_row] + local // capacity) * capacity + local % capacity
    slot = jnp.where(row < ends[-1], slot, -1)

    if num_blocks == groups:
        block_group = jnp.arange(groups, dtype=jnp.int32)
        within = jnp.zeros((groups,), jnp.int32)
    else:
        block = jnp.arange(num_blocks, dtype=jnp.int32)
        block_group = jnp.minimum(_count_at_most(first_block + per_group, num_blocks),
                                  groups - 1)
        within = (block - first_block[block_group]) * capacity
    local = within[:, None] + jnp.arange(capacity, dtype=jnp.int32)
    filled = local < group_sizes[block_group][:, None]
    block_row = jnp.where(filled, starts[block_group][:, None] + local, -1)
    return _Blocks(block_row.astype(jnp.int32), slot.astype(jnp.int32),
                   None if num_blocks == groups else block_group.astype(jnp.int32))


def _count_at_most(ends, n: int):
    """`[n]`: how many of the non-negative `ends` are <= i, for each i < n.

    `jnp.searchsorted(ends, jnp.arange(n), side="right")`, which on jax 0.12 fails inside a
    partial-manual `shard_map` with per-device `ends` (its shape rule); `O(n)` either way.
    """
    marks = jnp.zeros((n + 1,), jnp.int32).at[jnp.minimum(ends, n)].add(1)
    return jnp.cumsum(marks)[:n]


def _matmul_in_blocks(lhs, rhs, group_sizes, *, trans_b: bool, capacity: int, num_blocks: int):
    blocks = _blocks(group_sizes, lhs.shape[0], capacity, num_blocks)
    weights = rhs if blocks.group is None else rhs[blocks.group]
    spec = "bck,bpk->bcp" if trans_b else "bck,bkp->bcp"
    out = jnp.einsum(spec, take_rows(lhs, blocks.row), weights,
                     preferred_element_type=jnp.float32)
    return take_rows(out.reshape(-1, out.shape[-1]), blocks.slot)


def _outer_in_blocks(lhs, rhs, group_sizes, *, capacity: int, num_blocks: int):
    """`[G, K, P]`: `lhs_g^T @ rhs_g` for `lhs [N, K]`, `rhs [N, P]` (zero for empty groups)."""
    blocks = _blocks(group_sizes, lhs.shape[0], capacity, num_blocks)
    out = jnp.einsum("bck,bcp->bkp", take_rows(lhs, blocks.row), take_rows(rhs, blocks.row),
                     preferred_element_type=jnp.float32)
    if blocks.group is None:
        return out
    return jax.ops.segment_sum(out, blocks.group, group_sizes.shape[0], indices_are_sorted=True)


def block_capacities(rows: int, groups: int) -> tuple[int, ...]:
    """The static block sizes to choose from (`CAPACITIES` times the mean group size)."""
    mean = rows / max(groups, 1)
    return tuple(sorted({max(1, min(rows, _MULTIPLE * math.ceil(f * mean / _MULTIPLE)))
                         for f in CAPACITIES}))


def _in_blocks(fn, group_sizes, rows: int, *operands):
    """`fn(*operands, capacity=C, num_blocks=NB)` for the smallest `C` holding every group.

    When no capacity holds the largest group, groups span several blocks of the smallest size.
    """
    groups = group_sizes.shape[0]
    capacities = block_capacities(rows, groups)
    branches = [functools.partial(fn, capacity=c, num_blocks=groups) for c in capacities]
    if capacities[-1] < rows:  # a group may be larger than every block
        smallest = capacities[0]
        branches.append(functools.partial(fn, capacity=smallest,
                                          num_blocks=groups + rows // smallest))
    index = jnp.sum(jnp.max(group_sizes) > jnp.asarray(capacities, jnp.int32))
    return jax.lax.switch(jnp.minimum(index, len(branches) - 1), branches, *operands)


def _matmul(lhs, rhs, group_sizes, trans_b: bool):
    fn = functools.partial(_matmul_in_blocks, trans_b=trans_b)
    return _in_blocks(fn, group_sizes, lhs.shape[0], lhs, rhs, group_sizes)


def _outer(lhs, rhs, group_sizes):
    return _in_blocks(_outer_in_blocks, group_sizes, lhs.shape[0], lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs, rhs, group_sizes, trans_b: bool):
    return _matmul(lhs, rhs, group_sizes, trans_b)


def _grouped_fwd(lhs, rhs, group_sizes, trans_b):
    return _matmul(lhs, rhs, group_sizes, trans_b), (lhs, rhs, group_sizes)


def _grouped_bwd(trans_b, residuals, g):
    lhs, rhs, group_sizes = residuals
    d_lhs = _grouped(g, rhs, group_sizes, not trans_b)
    # d rhs[g] = lhs_g^T G_g, or its transpose G_g^T lhs_g when rhs holds op(rhs)^T.
    d_rhs = (_outer(g, lhs, group_sizes) if trans_b else _outer(lhs, g, group_sizes))
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
