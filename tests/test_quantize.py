"""Block quantizers (`jaxspeed.ops.quantize`) against a plain numpy reference.

Error model: round-to-nearest on a grid of step `scale = max|block| / qmax` puts each
dequantized element within `scale / 2` of the original (plus the fp32 rounding of `q * scale`,
one ulp of the block's largest value); the packed int4 layout must round-trip exactly.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.ops import quantize as qz


def reference(x: np.ndarray, bits: int, block: int):
    """numpy: per-block scale and the rounded integers, one block at a time."""
    flat = x.reshape(-1).astype(np.float64)
    blocks = -(-flat.size // block)
    flat = np.pad(flat, (0, blocks * block - flat.size)).reshape(blocks, block)
    scales = np.abs(flat).max(axis=1) / qz.QMAX[bits]
    q = np.zeros_like(flat)
    for i, s in enumerate(scales):
        if s > 0:
            q[i] = np.clip(np.round(flat[i] / s), -qz.QMAX[bits], qz.QMAX[bits])
    return q, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,block", [((3, 100), 64), ((1000,), 256), ((2, 3, 5), 8)])
def test_quantize_matches_reference_within_half_a_scale(bits, shape, block):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3
    x.reshape(-1)[:block] = 0.0  # an all-zero block: scale 0, exact zeros
    q = qz.quantize(jnp.asarray(x), bits=bits, block=block)
    want_q, want_scales = reference(x, bits, block)
    np.testing.assert_allclose(np.asarray(q.scales), want_scales, rtol=2**-23)
    assert q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.values.shape == (want_q.shape[0], block * bits // 8)
    back = np.asarray(qz.dequantize(q, shape, jnp.float32, bits=bits), np.float64)
    unpacked = np.asarray(qz.dequantize(qz.Quantized(q.values, jnp.ones_like(q.scales)),
                                        (want_q.size,), jnp.float32, bits=bits))
    np.testing.assert_array_equal(unpacked, want_q.reshape(-1))  # the integers, exactly
    scale = np.repeat(want_scales, block)[: x.size].reshape(shape)
    err = np.abs(back - x)
    assert np.all(err <= scale / 2 + np.abs(x).max() * 2**-23), err.max()
    assert np.all(back.reshape(-1)[:block] == 0)
    assert qz.quantized_bytes(x.size, bits=bits, block=block) == q.values.size + 4 * q.scales.size


def test_dequantize_keeps_leading_dims():
    x = jnp.arange(24, dtype=jnp.float32).reshape(2, 12) - 12
    q = qz.quantize(x[0], bits=4, block=4)
    stacked = qz.Quantized(jnp.stack([q.values, q.values]), jnp.stack([q.scales, q.scales]))
    out = qz.dequantize(stacked, (12,), jnp.bfloat16, bits=4)
    assert out.shape == (2, 12) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(out[1]))


@pytest.mark.parametrize("bits,block", [(3, 256), (8, 7)])
def test_bad_arguments(bits, block):
    with pytest.raises(ValueError, match="bits|block"):
        qz.quantize(jnp.ones(4), bits=bits, block=block)
