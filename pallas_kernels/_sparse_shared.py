"""What both block-sparse attention kernel families share (the Triton one in
`block_sparse_attention`, the Mosaic GPU one in `block_sparse_attention_mgpu`): the masked
logit, the layout's index tables and the custom VJP over a family's kernels. Its own module, so
that neither family imports the other's module."""

from __future__ import annotations

import functools

import jax
import numpy as np

from pallas_kernels._shapes import vary_like

#: Finite "minus infinity" for masked logits: exp2 of it is 0 and it never makes NaNs.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def layout_tables(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compresses a bool layout into row and column index tables (`block_sparse_attention`'s
    module docstring says how the kernels read them).

    Args:
      blocks: bool `[layout_heads, nb, nb]` (from `check_layout`).

    Returns:
      `(rows, cols)`, int32 `[layout_heads, nb, 1 + max_row]` and `[layout_heads, nb, 1 +
      max_col]`: entry 0 is the count, then the block indices in ascending order.
    """
    return _compress(blocks), _compress(np.swapaxes(blocks, 1, 2))


def _compress(blocks: np.ndarray) -> np.ndarray:
    heads, nb, _ = blocks.shape
    counts = blocks.sum(-1)
    width = max(int(counts.max()), 1)
    table = np.zeros((heads, nb, 1 + width), np.int32)
    table[..., 0] = counts
    for h in range(heads):
        for i in range(nb):
            idx = np.flatnonzero(blocks[h, i])
            if idx.size:
                table[h, i, 1:] = idx[-1]  # padding repeats a valid block: loads stay in range
                table[h, i, 1 : 1 + idx.size] = idx
    return table


def differentiable(forward, backward):
    """`attention(q, k, v, rows, cols, static)` with a custom VJP over a family's kernels
    (Triton here, Mosaic GPU in `block_sparse_attention_mgpu`): `forward(q, k, v, rows,
    static) -> (o, lse)` and `backward(q, k, v, rows, cols, o, lse, do, static) -> (dq, dk,
    dv)`, recomputing the probabilities from the saved log-sum-exp."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
    def attention(q, k, v, rows, cols, static):
        return forward(q, k, v, rows, static)[0]

    def attention_fwd(q, k, v, rows, cols, static):
        o, lse = forward(q, k, v, rows, static)
        return o, (q, k, v, rows, cols, o, lse)

    def attention_bwd(static, residuals, do):
        q, k, v, rows, cols, o, lse = residuals
        dq, dk, dv = backward(q, k, v, rows, cols, o, lse, do, static)
        return vary_like(dq, q), vary_like(dk, k), vary_like(dv, v), None, None

    attention.defvjp(attention_fwd, attention_bwd)
    return attention
