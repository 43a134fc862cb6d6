"""1-bit compressed all-reduce with worker and server error feedback.

The collective of 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed", Alg. 1; DeepSpeed's
`NcclBackend.compressed_allreduce`). Over `N` workers, for every leaf `x` of a pytree:

1. Worker side. `x` is flattened, zero-padded to `padded_size(x.size, N)` and added to its
   part of the worker error `e_w`: `y = x + e_w`. It is compressed to `C(y) = scale * sign(y)`
   with `scale = ||y||_2 / sqrt(len(y))` and `sign(0) = +1`, and `e_w <- y - C(y)`.
2. Phase 1 (one `all_to_all`). `y` is cut into `N` chunks; worker `j` receives chunk `j` of every
   worker: the sign bits packed 8 to a byte, plus every worker's scale.
3. Server side, on its chunk: `z = mean_i C_i(chunk) + e_s`, recompressed with its own scale
   (`||z||_2 / sqrt(len(z))`), and `e_s <- z - C(z)`.
4. Phase 2 (one `all_gather`). Every worker receives every server's packed chunk and scale,
   decompresses, and drops the padding: the result, identical on all workers.

Layout. All leaves are flattened into one matrix `[N, total]` whose row `j` holds chunk `j` of
every leaf, leaf after leaf (leaf `l`, padded to `N * chunk_l`, owns `chunk_l` columns), so the
arithmetic is a handful of vectorized ops and each phase is ONE collective on a `uint8` buffer:
the packed signs of all leaves followed by the leaves' float32 scales (bitcast to bytes). The
error buffers are flat vectors in this layout: `error_worker` is the row-major `[N * total]`,
`error_server` is `[total]`. Compression is still per leaf (one worker scale per leaf, one
server scale per leaf chunk, computed with segment sums), as DeepSpeed does for each tensor it
holds; per-leaf scales follow the layers' different magnitudes.

Padding: each leaf is padded to a multiple of `8 * N`, so that every chunk is a whole number of
bytes (DeepSpeed pads to `N * lcm(N, 8)`; `8 * N` is the smallest size that works). The padded
entries are part of the compressed vector (they count in `len(y)` and carry error), as in
DeepSpeed.

With `axis_name=None` the same arithmetic runs for one worker (`N = 1`), without communication.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

AxisName = str | tuple[str, ...] | None

_BITS = np.array([128, 64, 32, 16, 8, 4, 2, 1], np.uint8)  # big-endian, like np.packbits


def padded_size(size: int, num_workers: int) -> int:
    """The length a leaf of `size` elements is padded to: a positive multiple of `8 * N`.

    Args:
      size: number of elements of the leaf.
      num_workers: number of workers `N` of the all-reduce.

    Returns:
      `max(1, ceil(size / (8 N))) * 8 N`; the leaf's server chunk is this divided by `N`.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers}")
    unit = 8 * num_workers
    return max(1, math.ceil(size / unit)) * unit


def error_feedback_sizes(x: Any, *, num_workers: int) -> tuple[int, int]:
    """Lengths of the flat error buffers for a pytree shaped like `x`.

    Args:
      x: pytree of arrays (or shape-dtype structs).
      num_workers: number of workers `N` (1 for `axis_name=None`).

    Returns:
      `(worker, server)`: `worker = sum_l padded_size(leaf_l.size, N)`, `server = worker / N`.
    """
    worker = sum(padded_size(math.prod(leaf.shape), num_workers) for leaf in jax.tree.leaves(x))
    return worker, worker // num_workers


def init_error_feedback(x: Any, *, num_workers: int) -> tuple[jax.Array, jax.Array]:
    """Zero error buffers for `compressed_allreduce` of a pytree shaped like `x`.

    Returns:
      `(error_worker f32[worker], error_server f32[server])`, sizes from
      `error_feedback_sizes`.
    """
    worker, server = error_feedback_sizes(x, num_workers=num_workers)
    return jnp.zeros((worker,), jnp.float32), jnp.zeros((server,), jnp.float32)


def pack_signs(nonnegative: jax.Array) -> jax.Array:
    """Packs booleans 8 to a byte, first element in the most significant bit (np.packbits).

    Args:
      nonnegative: bool `[..., 8 k]` (True = sign +1).

    Returns:
      uint8 `[..., k]`.
    """
    if nonnegative.shape[-1] % 8:
        raise ValueError(
            f"pack_signs: the last dimension must be a multiple of 8, got shape "
            f"{nonnegative.shape}"
        )
    bits = nonnegative.reshape(*nonnegative.shape[:-1], -1, 8).astype(jnp.uint8)
    return jnp.sum(bits * jnp.asarray(_BITS), axis=-1, dtype=jnp.uint8)


def unpack_signs(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_signs`, as signs.

    Args:
      packed: uint8 `[..., k]`.

    Returns:
      float32 `[..., 8 k]`: +1 where the bit is set, -1 where it is clear.
    """
    bits = (packed[..., None] & jnp.asarray(_BITS)) != 0
    signs = jnp.where(bits, 1.0, -1.0).astype(jnp.float32)
    return signs.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def bound_axis_size(axis_name: AxisName, *, caller: str) -> int:
    """The number of workers over `axis_name` (1 for None), or a ValueError naming the axis."""
    if axis_name is None:
        return 1
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"{caller}: axis_name={axis_name!r} is not bound here. Call it inside "
            f"jax.shard_map over a mesh with that axis (each worker holding its local "
            f"values), or pass axis_name=None for a single worker."
        ) from None


class _Columns(NamedTuple):
    """Static layout of all leaves as the columns of one `[N, total]` matrix (module doc)."""

    chunks: tuple[int, ...]  # chunk_l = padded_l / N, multiples of 8
    offsets: np.ndarray  # int [L + 1], leaf l owns columns offsets[l]:offsets[l + 1]
    leaf_of_column: np.ndarray  # int32 [total]

    @classmethod
    def of(cls, leaves, num_workers: int) -> _Columns:
        chunks = tuple(padded_size(leaf.size, num_workers) // num_workers for leaf in leaves)
        return cls(
            chunks=chunks,
            offsets=np.cumsum([0, *chunks]),
            leaf_of_column=np.repeat(np.arange(len(chunks), dtype=np.int32), chunks),
        )

    def spread(self, per_leaf: jax.Array) -> jax.Array:
        """`[..., L]` -> `[..., total]`: each leaf's value on each of its columns."""
        return jnp.take(per_leaf, self.leaf_of_column, axis=-1)

    def compress(self, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """1-bit compression of each leaf's columns of `y` `[rows, total]`.

        Returns:
          `(nonnegative [rows, total], scales f32 [L], error [rows, total])`:
          `scale_l = ||y_l||_2 / sqrt(len(y_l))`, `C(y) = scale * sign(y)` with `sign(0) = +1`,
          `error = y - C(y)`.
        """
        squares = jnp.sum(jnp.square(y), axis=0)
        sums = jax.ops.segment_sum(
            squares, self.leaf_of_column, num_segments=len(self.chunks), indices_are_sorted=True
        )
        lengths = np.asarray(self.chunks, np.float32) * y.shape[0]
        scales = jnp.sqrt(sums) / np.sqrt(lengths)
        nonnegative = y >= 0
        error = y - self.spread(scales) * jnp.where(nonnegative, 1.0, -1.0)
        return nonnegative, scales, error


def _scales_to_bytes(scales: jax.Array) -> jax.Array:
    """f32 `[L]` -> u8 `[4 L]` (bitcast, exact)."""
    return jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(-1)


def _bytes_to_scales(data: jax.Array) -> jax.Array:
    """u8 `[..., 4 L]` -> f32 `[..., L]` (bitcast, exact)."""
    return jax.lax.bitcast_convert_type(data.reshape(*data.shape[:-1], -1, 4), jnp.float32)


def compressed_allreduce(
    x: Any, error_worker: jax.Array, error_server: jax.Array, *, axis_name: AxisName
) -> tuple[Any, jax.Array, jax.Array]:
    """Averages `x` over `axis_name` with 1-bit compression and error feedback.

    Call it inside `jax.shard_map` with each worker holding its own `x` and its own error
    buffers (they differ between workers); the result is the same on all workers (typed as
    invariant over `axis_name`).

    Args:
      x: pytree of float arrays, this worker's values.
      error_worker: f32 `[worker]`, this worker's compression error (`init_error_feedback`).
      error_server: f32 `[server]`, the error of the chunks this worker reduces.
      axis_name: mesh axis (or tuple of axes) to average over; None = one worker, no
        communication.

    Returns:
      `(mean, error_worker, error_server)`: `mean` like `x` (same shapes and dtypes), the
      decompressed average; the updated error buffers.

    Raises:
      ValueError: `axis_name` not bound, or error buffers of the wrong shape.
    """
    num_workers = bound_axis_size(axis_name, caller="compressed_allreduce")
    leaves, treedef = jax.tree.flatten(x)
    want = error_feedback_sizes(x, num_workers=num_workers)
    got = (tuple(np.shape(error_worker)), tuple(np.shape(error_server)))
    if got != ((want[0],), (want[1],)):
        raise ValueError(
            f"compressed_allreduce: over {num_workers} worker(s) these leaves need "
            f"error_worker of shape ({want[0]},) and error_server of shape ({want[1]},), got "
            f"{got[0]} and {got[1]} (see init_error_feedback; the sizes depend on the number "
            f"of workers)"
        )
    if not leaves:
        return x, error_worker, error_server
    cols = _Columns.of(leaves, num_workers)
    sign_bytes = int(cols.offsets[-1]) // 8

    # Worker side: y = x + e_w, compressed per leaf. Row j of the message goes to worker j.
    flats = [
        jnp.pad(leaf.reshape(-1).astype(jnp.float32), (0, num_workers * chunk - leaf.size))
        for leaf, chunk in zip(leaves, cols.chunks)
    ]
    y = jnp.concatenate(
        [f.reshape(num_workers, c) for f, c in zip(flats, cols.chunks)], axis=1
    ) + error_worker.reshape(num_workers, -1)
    nonnegative, scales, worker_error = cols.compress(y)
    scale_bytes = _scales_to_bytes(scales)
    scale_bytes = jnp.broadcast_to(scale_bytes, (num_workers, scale_bytes.size))
    message = jnp.concatenate([pack_signs(nonnegative), scale_bytes], axis=1)  # u8 [N, B]
    if axis_name is not None:
        message = jax.lax.all_to_all(message, axis_name, 0, 0, tiled=True)

    # Server side (row i now comes from worker i): average, add e_s, recompress.
    received = unpack_signs(message[:, :sign_bytes])  # [N, total]
    worker_scales = _bytes_to_scales(message[:, sign_bytes:])  # [N, L]
    average = jnp.sum(received * cols.spread(worker_scales / num_workers), axis=0)
    nonnegative, scales, server_error = cols.compress((average + error_server)[None])
    reply = jnp.concatenate([pack_signs(nonnegative[0]), _scales_to_bytes(scales)])
    if axis_name is None:
        gathered = reply[None]
    else:
        # Invariant result: shard_map knows the mean is the same on every worker.
        gathered = jax.lax.all_gather(reply, axis_name, to="invarying")  # u8 [N, B]

    server_scales = _bytes_to_scales(gathered[:, sign_bytes:])  # [N, L]
    mean = unpack_signs(gathered[:, :sign_bytes]) * cols.spread(server_scales)  # [N, total]
    means = [
        mean[:, a:b].reshape(-1)[: leaf.size].reshape(leaf.shape).astype(leaf.dtype)
        for a, b, leaf in zip(cols.offsets[:-1], cols.offsets[1:], leaves)
    ]
    return treedef.unflatten(means), worker_error.reshape(-1), server_error.reshape(-1)
