"""Attention over a sequence split across devices: DeepSpeed-Ulysses and ring attention.

Activations `[batch, length, ...]` are split along `length` over a mesh axis of `S` devices.
Everything but attention is per position, so only attention needs to cross the split:

- **ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an `all_to_all` turns the sequence
  shard into a head shard (`[b, L/S, H, d]` → `[b, L, H/S, d]`), attention runs on whole
  sequences of `H/S` heads with any single-device attention, and a second `all_to_all` turns
  it back. Each device sends `3/S` of its q, k, v and `1/S` of the output, whatever `S`: the
  volume per device stays constant as sequence and devices grow together. Needs the (local)
  head count divisible by `S`.
- **ring** (Liu et al. 2023, Ring Attention): each device keeps its queries, and the key/value
  shards travel around the ring (`ppermute`, sent while the current shard is computed), each
  step's part merged by its row logsumexp (`blocked.merge_parts`), so memory holds one shard
  of k/v at a time. The backward pass (`custom_vjp`) circulates k/v again and their gradients
  with them; after the last step each gradient is back with its owner. Any head count works.

Layouts of the sequence over the devices (`load_balance`):
- natural: device `i` holds chunk `i` of `S`;
- balanced: the sequence is cut into `2S` chunks and device `i` holds chunks `i` and
  `2S-1-i`. Under the causal mask chunk `c` attends to `c+1` chunks, so every device does the
  same work (the natural layout leaves device 0 one chunk and device `S-1` all of them).

`to_layout` / `from_layout` move `[batch, length, ...]` arrays between the two with two
`ppermute`s; `layout_positions` gives each row's position in the original sequence, for
rotary and learned position embeddings.

Every function here except the `*_local` ones takes global arrays and works under the current
mesh (`jax.set_mesh`), manual over the sequence axis (and the heads' axes) inside.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxspeed.attention.blocked import blocked_attention, flash_backward, flash_forward, merge_parts
from jaxspeed.errors import ConfigError
from jaxspeed.options.attention import SEQUENCE_IMPLS as IMPLS
from jaxspeed.sharding.vma import vary_alike

Array = jax.Array
_F32 = jnp.float32
#: How a ring step's chunk of queries sees a chunk of keys (`_Ring.mode`; `lax.switch` indices).
_FULL, _DIAGONAL, _NONE = 0, 1, 2



def chunk_order(shards: int, balanced: bool) -> np.ndarray:
    """The chunks of the original sequence in layout order (device 0's first)."""
    if not balanced:
        return np.arange(shards)
    first = np.arange(shards)
    return np.stack([first, 2 * shards - 1 - first], axis=1).reshape(-1)


def layout_positions(length: int, shards: int, balanced: bool) -> Array:
    """int32 `[length]`: the original position of each row of the layout."""
    order = chunk_order(shards, balanced)
    chunk = length // len(order)
    rows = jnp.arange(length, dtype=jnp.int32)
    return jnp.asarray(order, jnp.int32)[rows // chunk] * chunk + rows % chunk


def check_length(length: int, shards: int, balanced: bool, *, axis: str = "sequence") -> None:
    """A clear error when `length` cannot be cut into the layout's chunks."""
    chunks = 2 * shards if balanced else shards
    if length % chunks:
        why = (f"2 x {axis} = {chunks} chunks (load_balance: true)" if balanced
               else f"the {axis} axis size {shards}")
        raise ConfigError(
            f"sequence length {length} must be divisible by {why}; change data.seq_len"
            + (" or set model.sequence_parallel.load_balance: false" if balanced else "")
        )


# -- balanced layout ----------------------------------------------------------------------

def _owner(chunk: int, shards: int) -> int:
    """The device holding `chunk` (of `2 * shards`) in the balanced layout."""
    return chunk if chunk < shards else 2 * shards - 1 - chunk


def _parity_perms(shards: int) -> tuple[list, list]:
    """Natural → balanced moves: device `j`'s even chunk `2j`, and its odd chunk `2j+1`."""
    even = [(j, _owner(2 * j, shards)) for j in range(shards)]
    odd = [(j, _owner(2 * j + 1, shards)) for j in range(shards)]
    return even, odd


def _inverse(perm: list) -> list:
    return [(dst, src) for src, dst in perm]


def to_layout_local(x: Array, axis: str, shards: int, *, inverse: bool = False) -> Array:
    """Natural → balanced layout of a local shard `[batch, length/S, ...]` (inside
    `shard_map`); `inverse`: balanced → natural.

    In the natural layout device `j` holds chunks `2j` (even) and `2j+1` (odd) of `2S`; in the
    balanced one device `i` holds `i` and `2S-1-i`, one of them even and the other odd. Each
    parity moves with one `ppermute`, a permutation of the devices.
    """
    if shards == 1:
        return x
    even_perm, odd_perm = _parity_perms(shards)
    first, second = jnp.split(x, 2, axis=1)
    even_device = jax.lax.axis_index(axis) % 2 == 0
    if inverse:  # device i's chunk i is even on an even device
        even = jnp.where(even_device, first, second)
        odd = jnp.where(even_device, second, first)
        return jnp.concatenate([jax.lax.ppermute(even, axis, _inverse(even_perm)),
                                jax.lax.ppermute(odd, axis, _inverse(odd_perm))], axis=1)
    even = jax.lax.ppermute(first, axis, even_perm)
    odd = jax.lax.ppermute(second, axis, odd_perm)
    return jnp.concatenate([jnp.where(even_device, even, odd),
                            jnp.where(even_device, odd, even)], axis=1)


def to_layout(x: Array, axis: str, *, inverse: bool = False) -> Array:
    """`[batch, length, ...]` split over `axis`, natural → balanced (`inverse`: back)."""
    shards = _axis_size(axis)
    if shards == 1:
        return x
    check_length(x.shape[1], shards, balanced=True, axis=axis)
    spec = P(None, axis)
    body = functools.partial(to_layout_local, axis=axis, shards=shards, inverse=inverse)
    return jax.shard_map(body, in_specs=spec, out_specs=spec, axis_names=frozenset({axis}))(x)


def from_layout(x: Array, axis: str) -> Array:
    """Balanced → natural layout (`to_layout(..., inverse=True)`)."""
    return to_layout(x, axis, inverse=True)


def _axis_size(axis: str) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or axis not in mesh.axis_names else mesh.shape[axis]


def _reorder_chunks(x: Array, order: np.ndarray) -> Array:
    """`[batch, length, ...]` cut into `len(order)` chunks, chunk `order[i]` placed at `i`."""
    b, length = x.shape[:2]
    chunks = x.reshape(b, len(order), length // len(order), *x.shape[2:])
    return jnp.take(chunks, jnp.asarray(order), axis=1).reshape(x.shape)


# -- Ulysses ------------------------------------------------------------------------------

def ulysses_local(
    q: Array, k: Array, v: Array, *, axis: str, shards: int, balanced: bool,
    attend: Callable[[Array, Array, Array], Array],
) -> Array:
    """DeepSpeed-Ulysses on local shards `[batch, length/S, heads, dim]` (inside `shard_map`).

    `attend(q, k, v)` is any attention on whole sequences `[batch, length, heads/S, dim]`
    in original order.
    """
    heads = q.shape[2]
    if heads % shards:
        raise ConfigError(
            f"sequence_parallel.impl=ulysses splits the {heads} attention heads (per tensor "
            f"shard) over the {shards} devices of mesh axis {axis!r}, which does not divide "
            f"them; use model.sequence_parallel.impl: ring, which works with any head count"
        )

    def to_heads(x):
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = map(to_heads, (q, k, v))
    order = chunk_order(shards, balanced)
    if balanced:  # the gathered sequence is in layout order: put it in original order
        q, k, v = (_reorder_chunks(x, np.argsort(order)) for x in (q, k, v))
    y = attend(q, k, v)
    if balanced:
        y = _reorder_chunks(y, order)
    return jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=2, tiled=True)


# -- ring ---------------------------------------------------------------------------------

class _Ring(NamedTuple):
    """The static facts of one ring attention call."""

    axis: str
    shards: int
    causal: bool
    balanced: bool
    scale: float
    block_q: int
    block_kv: int

    @property
    def chunks(self) -> int:
        """Chunks per device: 2 balanced, 1 natural."""
        return 2 if self.balanced else 1

    def chunk_id(self, device: Array, slot: int) -> Array:
        """The original chunk index of `device`'s `slot`-th chunk."""
        return 2 * self.shards - 1 - device if slot else device

    def mode(self, me: Array, src: Array, a: int, b: int) -> Array | int:
        """How `me`'s chunk slot `a` of queries sees `src`'s chunk slot `b` of keys: `_FULL`
        (all keys), `_DIAGONAL` (causal inside) or `_NONE`.

        A Python int where it is the same on every device and step: without causality, and
        for the balanced layout's crossed slots (a device's first chunk, `me < S`, precedes
        every device's second, `2S - 1 - src >= S`). Otherwise a traced one, for `lax.switch`.
        """
        if not self.causal:
            return _FULL
        if a != b:
            return _NONE if a < b else _FULL
        q_chunk, kv_chunk = self.chunk_id(me, a), self.chunk_id(src, b)
        diagonal_or_none = jnp.where(q_chunk == kv_chunk, _DIAGONAL, _NONE)
        return jnp.where(q_chunk > kv_chunk, _FULL, diagonal_or_none)

    def pairs(self, me: Array, src: Array) -> Iterator[tuple[int, int, Array | int]]:
        """`(a, b, mode)` for each of `me`'s query slots `a` and `src`'s key slots `b`, less the
        pairs no device computes (`mode` statically `_NONE`)."""
        for a in range(self.chunks):
            for b in range(self.chunks):
                mode = self.mode(me, src, a, b)
                if not (isinstance(mode, int) and mode == _NONE):
                    yield a, b, mode

    def flash(self, causal: bool) -> dict:
        return dict(causal=causal, scale=self.scale, block_q=self.block_q, block_kv=self.block_kv)


def ring_local(
    q: Array, k: Array, v: Array, *, axis: str, shards: int, causal: bool, balanced: bool,
    sm_scale: float | None = None, block_q: int = 512, block_kv: int = 512,
) -> Array:
    """Ring attention on local shards `[batch, length/S, heads, dim]` (inside `shard_map`),
    each step's block pairs computed by the blocked (FlashAttention) kernel."""
    scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    ring = _Ring(axis, shards, bool(causal), bool(balanced), scale, block_q, block_kv)
    q, k, v = vary_alike(q, k, v)
    return _ring(ring, q, k, v)


def _split(x: Array, n: int) -> list[Array]:
    return jnp.split(x, n, axis=1) if n > 1 else [x]


def _join(xs: Sequence[Array]) -> Array:
    return jnp.concatenate(xs, axis=1) if len(xs) > 1 else xs[0]


def _pair_forward(ring: _Ring, mode, q, k, v):
    def full(q, k, v):
        return flash_forward(q, k, v, **ring.flash(False))

    def diagonal(q, k, v):
        return flash_forward(q, k, v, **ring.flash(True))

    def none(q, k, v):
        return jnp.zeros_like(q, _F32), jnp.full_like(q[..., 0], -jnp.inf, _F32)

    branches = (full, diagonal, none)  # in the order of _FULL, _DIAGONAL, _NONE
    if isinstance(mode, int):
        return branches[mode](q, k, v)
    return jax.lax.switch(mode, branches, q, k, v)


def _pair_backward(ring: _Ring, mode, q, k, v, out, lse, d_out):
    def grads(causal):
        return lambda *xs: flash_backward(*xs, **ring.flash(causal))

    def none(q, k, v, *_):
        return jnp.zeros_like(q, _F32), jnp.zeros_like(k, _F32), jnp.zeros_like(v, _F32)

    args = (q, k, v, out, lse, d_out)
    branches = (grads(False), grads(True), none)  # in the order of _FULL, _DIAGONAL, _NONE
    if isinstance(mode, int):
        return branches[mode](*args)
    return jax.lax.switch(mode, branches, *args)


def _ring_perm(shards: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % shards) for i in range(shards)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v):
    return _ring_forward(ring, q, k, v)[0]


def _ring_forward(ring: _Ring, q, k, v):
    """The output (in `v`'s dtype) and its row logsumexp `[batch, length/S, heads]`."""
    me = jax.lax.axis_index(ring.axis)
    qs = _split(q, ring.chunks)

    def attend_to(t, k_t, v_t, outs, lses):  # k_t, v_t: device (me - t)'s shard
        src = (me - t) % ring.shards
        ks, vs = _split(k_t, ring.chunks), _split(v_t, ring.chunks)
        outs, lses = list(outs), list(lses)
        for a, b, mode in ring.pairs(me, src):
            part = _pair_forward(ring, mode, qs[a], ks[b], vs[b])
            outs[a], lses[a] = merge_parts(outs[a], lses[a], *part)
        return outs, lses

    def step(carry, t):
        k_t, v_t, outs, lses = carry
        k_next, v_next = jax.lax.ppermute((k_t, v_t), ring.axis, _ring_perm(ring.shards))
        return (k_next, v_next, *attend_to(t, k_t, v_t, outs, lses)), None

    outs = [jnp.zeros_like(x, _F32) for x in qs]
    lses = [jnp.full_like(x[..., 0], -jnp.inf, _F32) for x in qs]
    # All S steps in the loop, the last one's send (k, v back home) unused. Peeling that step
    # out of the loop doubled the attention code XLA compiles (a ring train step took 1.6x as
    # long to compile, and ran no faster on CPU); the extra send overlaps the last step.
    (_, _, outs, lses), _ = jax.lax.scan(step, (k, v, outs, lses), jnp.arange(ring.shards))
    return _join(outs).astype(v.dtype), _join(lses)


def _ring_fwd(ring: _Ring, q, k, v):
    out, lse = _ring_forward(ring, q, k, v)
    return out, (q, k, v, out, lse)


def _ring_bwd(ring: _Ring, residuals, d_out):
    q, k, v, out, lse = residuals
    me = jax.lax.axis_index(ring.axis)
    n = ring.chunks
    qs, outs, lses, d_outs = (_split(x, n) for x in (q, out, lse, d_out))
    perm = _ring_perm(ring.shards)

    def grads_of(t, k_t, v_t, dk_t, dv_t, dqs):  # adds the pairs with device (me - t)'s k, v
        src = (me - t) % ring.shards
        ks, vs, dks, dvs = (_split(x, n) for x in (k_t, v_t, dk_t, dv_t))
        dqs = list(dqs)
        for a, b, mode in ring.pairs(me, src):
            dq, dk, dv = _pair_backward(
                ring, mode, qs[a], ks[b], vs[b], outs[a], lses[a], d_outs[a])
            dqs[a], dks[b], dvs[b] = dqs[a] + dq, dks[b] + dk, dvs[b] + dv
        return _join(dks), _join(dvs), dqs

    def step(carry, t):
        k_t, v_t, dk_t, dv_t, dqs = carry
        k_next, v_next = jax.lax.ppermute((k_t, v_t), ring.axis, perm)
        dk_t, dv_t, dqs = grads_of(t, k_t, v_t, dk_t, dv_t, dqs)
        dk_next, dv_next = jax.lax.ppermute((dk_t, dv_t), ring.axis, perm)
        return (k_next, v_next, dk_next, dv_next, dqs), None

    init = (k, v, jnp.zeros_like(k, _F32), jnp.zeros_like(v, _F32),
            [jnp.zeros_like(x, _F32) for x in qs])
    # S steps, as in the forward pass: the last one's dk, dv send is their hop home
    (_, _, dk, dv, dqs), _ = jax.lax.scan(step, init, jnp.arange(ring.shards))
    return _join(dqs).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


# -- on global arrays ---------------------------------------------------------------------

def sequence_parallel_attention(
    q: Array, k: Array, v: Array, *, impl: str, axis: str, head_axes: Sequence[str] = (),
    causal: bool = True, load_balance: bool = True,
    attend: Callable[[Array, Array, Array], Array] | None = None,
    block_q: int = 512, block_kv: int = 512,
) -> Array:
    """Attention on `[batch, length, heads, dim]` arrays whose `length` is split over `axis`.

    Args:
      q, k, v: global arrays, in the layout `load_balance` names (see the module docstring).
      impl: `ulysses` or `ring`.
      axis: the mesh axis `length` is split over (the current mesh's).
      head_axes: mesh axes the heads are split over (tensor parallelism); manual inside too,
        so Ulysses splits each tensor shard's heads further.
      causal: the causal mask, by original position.
      load_balance: the inputs are in the balanced layout (output likewise).
      attend: Ulysses' attention on whole sequences, `(q, k, v) -> out`; default the blocked
        (FlashAttention) kernel with `causal`.
      block_q, block_kv: blocks of the default `attend` and of ring's kernel.

    Returns:
      `[batch, length, heads, dim]`, the layout of the inputs, in `v`'s dtype.
    """
    if impl not in IMPLS:
        raise ConfigError(
            f"model.sequence_parallel.impl: got {impl!r}; accepted values are {list(IMPLS)}")
    shards = _axis_size(axis)
    check_length(q.shape[1], shards, load_balance, axis=axis)
    if shards == 1:
        raise ValueError(f"mesh axis {axis!r} does not split the sequence (size 1)")
    if impl == "ulysses":
        if attend is None:
            attend = functools.partial(
                blocked_attention, causal=causal, block_q=block_q, block_kv=block_kv)
        body = functools.partial(
            ulysses_local, axis=axis, shards=shards, balanced=load_balance, attend=attend)
    else:
        body = functools.partial(
            ring_local, axis=axis, shards=shards, causal=causal, balanced=load_balance,
            block_q=block_q, block_kv=block_kv)
    heads = tuple(head_axes)
    spec = P(None, axis, (heads[0] if len(heads) == 1 else heads) if heads else None)
    return jax.shard_map(
        body, in_specs=(spec, spec, spec), out_specs=spec,
        axis_names=frozenset({axis, *heads}),
    )(q, k, v)
