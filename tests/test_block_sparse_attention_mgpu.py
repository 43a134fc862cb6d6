"""Block-sparse attention as Mosaic GPU kernels (pallas_kernels/block_sparse_attention_mgpu.py).

The kernels run on CPU in Pallas' GPU interpret mode, which simulates the GPU's memories,
warpgroups, TMA copies and mbarriers and checks every SMEM/GMEM access for data races; their
output and the gradients of q, k and v are compared with `dense_reference`. Every tiling that
`auto_config` picks is also compiled, forward and backward, for an H100 and an H200 without a
GPU (XLA:GPU down to a cubin, `tests/gpu_compile.py`).
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from gpu_compile import compile_for_gpu, needs_gpu_compile
from numerics import assert_close, mixed_rtol
from test_block_sparse_attention import qkv_do, random_layout, value_and_grads

# With `detect_races=True` (and the default `on_race="raise"`) the interpreter raises
# "RACE DETECTED" on a race; resetting its global state between tests and reading its record
# have no public API in jax 0.12.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jaxspeed.attention import sparsity
from jaxspeed.attention.block_sparse import dense_reference
from pallas_kernels import block_sparse_attention_mgpu as mgpu
from pallas_kernels.block_sparse_attention import check_layout

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)


@pytest.fixture
def race_free():
    """Resets GPU interpret mode's global state, and asserts after the test that the race
    detector found no race."""
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield
    assert not interpret_pallas_call.get_races().races_found


def mgpu_rtol(dtype, *, backward: bool) -> float:
    """The kernels vs the dense fp32 reference (tests/numerics.py, points 2 and 4).

    Both sum in fp32 (wgmma accumulates in fp32): reductions of at most max(seq, head_dim)
    terms, 3 chained forward and 3 per forward reduction with the backward. The kernels round
    to 16 bits: p before `p @ v` and the output; with the backward also ds before `ds @ k` /
    `ds^T @ q` and the gradient itself. fp32 inputs are rounded to bf16 at entry (q, k, v, and
    the cotangent), two more roundings on every chain, and bf16 holds all of them.
    """
    casts = 4 if backward else 2
    low = "bfloat16" if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype).name
    if low != jnp.dtype(dtype).name:
        casts += 2 if backward else 1
    return mixed_rtol(width=SEQ, depth=9 if backward else 3, casts=casts, dtype=low)


SEQ, DIM = 256, 64


def check_against_reference(layout, *, causal, dtype, batch=1, heads=2, seed=0):
    scale = 1 / math.sqrt(DIM)
    blocks = check_layout(layout, num_heads=heads, seq_len=SEQ, causal=causal)
    q, k, v, do = qkv_do(seed, (batch, SEQ, heads, DIM), dtype)
    got = value_and_grads(lambda q, k, v: mgpu.attention(
        q, k, v, blocks, causal=causal, sm_scale=scale, interpret=INTERPRET), q, k, v, do)
    want = value_and_grads(lambda q, k, v: dense_reference(
        q, k, v, layout, causal=causal, sm_scale=scale), q, k, v, do)
    assert got[0].dtype == q.dtype and got[0].shape == q.shape
    assert_close(got[0], want[0], rtol=mgpu_rtol(dtype, backward=False))
    assert_close(got[1], want[1], rtol=mgpu_rtol(dtype, backward=True))


# ---- GPU interpret mode -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,causal,layout_heads,block",
    [
        (jnp.bfloat16, True, 2, 64),
        (jnp.float32, False, 1, 64),
        (jnp.float16, True, 1, 128),  # a block of two 64-row tiles
        pytest.param(jnp.float32, True, 2, 128, marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, False, 2, 64, marks=pytest.mark.slow),
    ],
    ids=["bf16-causal-per-head", "fp32-shared", "fp16-causal-block128", "fp32-causal-block128",
         "bf16-per-head"],
)
def test_random_layouts_match_dense_reference(race_free, dtype, causal, layout_heads, block):
    layout = random_layout(block + layout_heads, heads=layout_heads, nb=SEQ // block, density=0.4,
                           causal=causal)
    check_against_reference(layout, causal=causal, dtype=dtype, batch=2 if block == 128 else 1)


CONFIGS = {
    "fixed": sparsity.FixedSparsityConfig(num_heads=2, block=64, num_local_blocks=2,
                                          attention="unidirectional"),
    "bigbird": sparsity.BigBirdSparsityConfig(
        num_heads=2, block=64, num_random_blocks=1, num_sliding_window_blocks=3,
        num_global_blocks=1, different_layout_per_head=True),
    "longformer": sparsity.BSLongformerSparsityConfig(num_heads=2, block=64,
                                                      num_sliding_window_blocks=3),
}


@pytest.mark.parametrize(
    "name,dtype",
    [("fixed", jnp.bfloat16), ("bigbird", jnp.float32),
     pytest.param("longformer", jnp.bfloat16, marks=pytest.mark.slow)],
)
def test_deepspeed_layouts_match_dense_reference(race_free, name, dtype):
    config = CONFIGS[name]
    causal = getattr(config, "attention", "bidirectional") == "unidirectional"
    check_against_reference(config.make_layout(SEQ), causal=causal, dtype=dtype, seed=1)


# ---- the interface ------------------------------------------------------------------------------


def test_a_config_over_the_shared_memory_limit_is_refused_before_launch():
    blocks = np.ones((1, 2, 2), bool)
    q = jnp.zeros((1, 256, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError) as error:  # interpret=None: a launch would need a GPU
        mgpu.attention(q, q, q, blocks, causal=False, sm_scale=0.1, config=mgpu.Config(128, 64, 4))
    message = str(error.value)
    assert "\n" not in message
    assert "block 128 x head_dim 128 in bfloat16 with 4 stages needs" in message
    assert "limit of 232448 (shared_memory_per_block_optin)" in message
    with pytest.raises(ValueError, match="limit of 99000"):
        mgpu.check_fits(mgpu.Config(128), 128, jnp.float16, 99000)
    mgpu.check_fits(mgpu.auto_config(128, 128, jnp.float16), 128, jnp.float16, 232448)


def test_unsupported_shapes_are_one_line_errors():
    assert mgpu.supports(64, 128, jnp.float32) and mgpu.supports(128, 64, jnp.bfloat16)
    for block, dim, dtype in [(32, 64, jnp.bfloat16), (64, 96, jnp.bfloat16),
                              (256, 64, jnp.float16), (64, 64, jnp.int8)]:
        assert not mgpu.supports(block, dim, dtype)
        q = jnp.zeros((1, 4 * block, 1, dim), dtype)
        with pytest.raises(ValueError, match="supports block in") as error:
            mgpu.attention(q, q, q, np.ones((1, 4, 4), bool), causal=False, sm_scale=1.0)
        assert "\n" not in str(error.value)
    q = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="config must be for block 64"):
        mgpu.attention(q, q, q, np.ones((1, 4, 4), bool), causal=False, sm_scale=1.0,
                       config=mgpu.Config(128))
    assert set(mgpu.AUTO_CONFIGS) == {
        (block, dim, dtype) for block in mgpu.BLOCKS for dim in mgpu.HEAD_DIMS
        for dtype in mgpu.DTYPES}
    assert all(config.block == key[0] for key, config in mgpu.AUTO_CONFIGS.items())


# ---- compiled for Hopper, without a GPU --------------------------------------------------------


def grad_of_attention(blocks, *, causal, config=None, smem_limit=mgpu.HOPPER_SMEM_LIMIT):
    def loss(q, k, v):
        out = mgpu.attention(q, k, v, blocks, causal=causal, sm_scale=0.125, config=config,
                             smem_limit=smem_limit)
        return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


@needs_gpu_compile
@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize("key", list(mgpu.AUTO_CONFIGS), ids=lambda k: "-".join(map(str, k)))
def test_every_auto_config_compiles_for_hopper(key, target):
    block, dim, dtype = key
    blocks = np.array([[[1, 0, 0], [1, 1, 0], [0, 1, 1]], [[1, 0, 0], [0, 1, 0], [1, 0, 1]]])
    x = jax.ShapeDtypeStruct((1, 3 * block, 2, dim), jnp.dtype(dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile_for_gpu(grad_of_attention(blocks, causal=True), x, x, x,
                                   target=target)
    assert not [w for w in caught if "Triton" in str(w.message)]
    assert compiled.as_text().count('custom_call_target="mosaic_gpu') == 3  # fwd, dq, dk/dv


@needs_gpu_compile
def test_check_fits_refuses_what_mosaic_refuses():
    """At block 128 x head_dim 128 in bf16, 3 stages is the first ring over Hopper's limit:
    `check_fits` refuses it, and Mosaic GPU, asked to compile it anyway, counts it over too."""
    config, blocks = mgpu.Config(128, 64, 3), np.ones((1, 2, 2), bool)
    with pytest.raises(ValueError, match="with 3 stages needs"):
        mgpu.check_fits(config, 128, jnp.bfloat16, mgpu.HOPPER_SMEM_LIMIT)
    x = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)
    fn = grad_of_attention(blocks, causal=False, config=config, smem_limit=10**9)
    with pytest.raises(Exception, match="exceeds available shared memory"):
        compile_for_gpu(fn, x, x, x, target="h100")
