"""Block-sparse attention: the Pallas kernels and the XLA path of jaxspeed.attention.block_sparse.

Both paths, the Pallas kernels (interpreted on CPU, compiled on a GPU) and the gather-based XLA
path, are checked against `dense_reference`, a dense masked softmax over the expanded layout, in
the output and in the gradients of q, k and v, in fp32, bf16 and fp16. The kernels run in the
Pallas interpreter, which is slow to compile, so their cases are tiny; the XLA path also runs
at seq 256-1024.
"""

import importlib.util
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_lowering import lower_for_cuda
from numerics import assert_close, mixed_rtol, program_rtol

from jaxspeed.attention import sparsity
from jaxspeed.attention.block_sparse import (_kernel_takes, block_sparse_attention, dense_reference,
                                             expand_layout)
from pallas_kernels.backend import on_gpu
from pallas_kernels.block_sparse_attention import block_sparse_attention as pallas_attention
from pallas_kernels.block_sparse_attention import check_layout, layout_tables

ROOT = Path(__file__).resolve().parent.parent


def attention_rtol(q, *, backward=True):
    """Kernel or gather path vs the dense reference (tests/numerics.py).

    Both sum in fp32: scores over head_dim, softmax and `p @ v` over the keys, so sums of at
    most max(seq, head_dim) terms, 3 chained forward, and the backward's two products per
    forward reduction. In bf16/fp16 both paths still accumulate in fp32; the kernels round 4
    values on the way to dq/dk to q's dtype (p before `p @ v`, the output, ds before `ds @ k`,
    the gradient itself), each a width-1 reduction in that dtype (point 4).
    """
    _, seq, _, head_dim = q.shape
    width, depth = max(seq, head_dim), 3 * 3 if backward else 3
    if q.dtype == jnp.float32:
        return program_rtol(width=width, depth=depth)
    return mixed_rtol(width=width, depth=depth, casts=4 if backward else 2, dtype=q.dtype)


def jit(fn):
    return jax.jit(fn)


def random_layout(seed, *, heads, nb, density=0.3, causal=False):
    """A random 0/1 layout `[heads, nb, nb]` where every row is non-empty (after the causal
    mask) and a few rows hold a single block."""
    rng = np.random.default_rng(seed)
    layout = (rng.random((heads, nb, nb)) < density).astype(np.int32)
    for h in range(heads):
        for i in range(nb):
            if rng.random() < 0.25 or not layout[h, i, : i + 1 if causal else nb].any():
                layout[h, i] = 0  # a single-block row
                layout[h, i, rng.integers(0, i + 1 if causal else nb)] = 1
    return layout


def qkv_do(seed, shape, dtype):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def value_and_grads(fn, q, k, v, do):
    """Output and `(dq, dk, dv)` for the cotangent `do`, in one jitted call."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do)

    return jit(run)(q, k, v, do)


def check_against_reference(q, k, v, do, layout, *, causal, impl, sm_scale=None):
    if impl == "pallas" and not _kernel_takes(q, layout):
        # only in the GPU suite's run on Hopper, whose Mosaic GPU kernel takes blocks and head
        # dims of 64 or 128 in 16 bits (its own tests: test_block_sparse_attention_mgpu.py)
        pytest.skip("the Mosaic GPU kernel does not take this block, head dim or dtype")
    kwargs = dict(causal=causal, sm_scale=sm_scale)
    got = value_and_grads(
        lambda q, k, v: block_sparse_attention(q, k, v, layout, impl=impl, **kwargs), q, k, v, do)
    want = value_and_grads(lambda q, k, v: dense_reference(q, k, v, layout, **kwargs), q, k, v, do)
    assert got[0].dtype == q.dtype and got[0].shape == q.shape
    assert_close(got, want, rtol=attention_rtol(q))


# ---- the Pallas kernels (interpreted) -----------------------------------------------------------


@pytest.mark.parametrize(
    "causal,layout_heads,block",
    [
        (True, 2, 16),
        pytest.param(False, 1, 16, marks=pytest.mark.slow),
        pytest.param(False, 2, 8, marks=pytest.mark.slow),
    ],
    ids=["causal-per-head", "shared", "block8"],
)
def test_pallas_matches_dense_reference_fp32(causal, layout_heads, block):
    if block < 16 and on_gpu():
        pytest.skip("the compiled (Triton) kernel needs blocks >= 16; block 8 is interpreted only")
    seq, heads, dim = 64, 2, 16
    layout = random_layout(1, heads=layout_heads, nb=seq // block, causal=causal)
    q, k, v, do = qkv_do(0, (1, seq, heads, dim), jnp.float32)
    check_against_reference(q, k, v, do, layout, causal=causal, impl="pallas")


@pytest.mark.slow
def test_pallas_matches_dense_reference_bf16_block32():
    seq, heads, dim = 64, 2, 32
    layout = random_layout(2, heads=heads, nb=seq // 32, causal=True)
    q, k, v, do = qkv_do(1, (1, seq, heads, dim), jnp.bfloat16)
    check_against_reference(q, k, v, do, layout, causal=True, impl="pallas")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,dim", [(jnp.float16, 64), (jnp.float32, 24)],
                         ids=["fp16-dim64", "fp32-dim24"])
def test_pallas_fp16_and_padded_head_dim(dtype, dim):
    seq, heads = 64, 2
    layout = random_layout(3, heads=heads, nb=4, causal=False)
    q, k, v, do = qkv_do(2, (2, seq, heads, dim), dtype)
    check_against_reference(q, k, v, do, layout, causal=False, impl="pallas", sm_scale=0.3)


@pytest.mark.parametrize(
    "dim,block,dtype,causal,layout_heads",
    [(64, 64, jnp.bfloat16, True, 1), (128, 128, jnp.float16, False, 2)],
)
@pytest.mark.parametrize(("device_kind", "call"), [("NVIDIA A100-SXM4-80GB", "__gpu$xla.gpu.triton"),
                                                   ("NVIDIA H200", "mosaic_gpu_v2")])
def test_pallas_lowers_for_triton(dim, block, dtype, causal, layout_heads, device_kind, call):
    """The kernels lower for NVIDIA GPUs: Triton on an A100, Mosaic GPU on Hopper, chosen by
    the device lowered for (`tests/test_gpu_compile.py` compiles them too, with the plugin)."""
    seq, heads = 4 * block, 2
    layout = random_layout(4, heads=layout_heads, nb=seq // block, causal=causal)
    x = jax.ShapeDtypeStruct((1, seq, heads, dim), dtype)

    def loss(q, k, v):
        out = pallas_attention(q, k, v, layout, causal=causal)
        return out.astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, device_kind=device_kind)
    assert text.count(f"custom_call @{call}(") == 3  # forward, dq, dk/dv


def test_compiled_kernel_rejects_small_or_odd_blocks():
    q = jnp.zeros((1, 48, 1, 16))
    with pytest.raises(ValueError, match="power of 2 and >= 16"):
        pallas_attention(q, q, q, np.ones((1, 4, 4)), interpret=False, backend="triton")


def test_hopper_refuses_sizes_its_kernel_lacks_and_never_falls_back_to_triton():
    """On sm_90 a block the Mosaic GPU kernel does not take is one clear error (no silent
    Triton); jaxspeed's impl="auto" takes its XLA path for it instead."""
    x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    layout = np.ones((1, 4, 4))  # block 32
    with pytest.raises(ValueError, match=r"Mosaic GPU\) supports block in \(64, 128\)"):
        lower_for_cuda(lambda q, k, v: pallas_attention(q, k, v, layout), x, x, x)
    text = lower_for_cuda(lambda q, k, v: block_sparse_attention(q, k, v, layout), x, x, x)
    assert "custom_call @mosaic_gpu" not in text and "triton" not in text


def test_layout_tables_list_rows_and_columns():
    blocks = np.array([[[1, 0, 1], [0, 1, 0], [1, 1, 1]]], bool)
    rows, cols = layout_tables(blocks)
    np.testing.assert_array_equal(rows[0], [[2, 0, 2, 2], [1, 1, 1, 1], [3, 0, 1, 2]])
    np.testing.assert_array_equal(cols[0], [[2, 0, 2], [2, 1, 2], [2, 0, 2]])


# ---- the XLA path --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq,block,layout_heads,causal,dtype",
    [
        (128, 16, 4, False, jnp.float32),
        (128, 16, 4, True, jnp.bfloat16),
        pytest.param(256, 32, 1, True, jnp.float32, marks=pytest.mark.slow),
        pytest.param(128, 16, 4, True, jnp.float32, marks=pytest.mark.slow),
        pytest.param(256, 32, 4, False, jnp.float16, marks=pytest.mark.slow),
        pytest.param(1024, 64, 1, True, jnp.float32, marks=pytest.mark.slow),
        pytest.param(1024, 64, 4, False, jnp.float32, marks=pytest.mark.slow),
    ],
)
def test_xla_matches_dense_reference(seq, block, layout_heads, causal, dtype):
    heads, dim = 4, 32 if seq <= 256 else 16
    layout = random_layout(seq + block, heads=layout_heads, nb=seq // block, causal=causal)
    q, k, v, do = qkv_do(seq, (1, seq, heads, dim), dtype)
    check_against_reference(q, k, v, do, layout, causal=causal, impl="xla")


CONFIGS = [
    sparsity.DenseSparsityConfig(num_heads=2, block=16),
    sparsity.FixedSparsityConfig(num_heads=2, block=16, attention="unidirectional"),
    sparsity.FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2,
                                 different_layout_per_head=True, num_different_global_patterns=2),
    sparsity.VariableSparsityConfig(num_heads=2, block=16),
    sparsity.BigBirdSparsityConfig(num_heads=2, block=16, different_layout_per_head=True),
    sparsity.BSLongformerSparsityConfig(num_heads=2, block=16),
    sparsity.LocalSlidingWindowSparsityConfig(num_heads=2, block=16),
]


@pytest.mark.parametrize(
    "config",
    [CONFIGS[1], *(pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS[:1] + CONFIGS[2:])],
    ids=lambda c: type(c).__name__,
)
def test_xla_matches_dense_reference_for_each_config(config):
    seq = 128
    layout = config.make_layout(seq)
    causal = getattr(config, "attention", "bidirectional") == "unidirectional"
    q, k, v, do = qkv_do(7, (1, seq, 2, 16), jnp.float32)
    check_against_reference(q, k, v, do, layout, causal=causal, impl="xla")


# ---- the blocked path: the set blocks one at a time (online softmax) ---------------------------


@pytest.mark.parametrize("causal,dtype", [(True, jnp.float32), (False, jnp.float32),
                                          (True, jnp.bfloat16)], ids=["causal", "full", "bf16"])
def test_blocked_matches_dense_reference(causal, dtype):
    seq, block = 128, 16
    layout = random_layout(3, heads=1, nb=seq // block, causal=causal)
    q, k, v, do = qkv_do(seq, (2, seq, 4, 16), dtype)
    check_against_reference(q, k, v, do, layout, causal=causal, impl="blocked")


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[5], CONFIGS[6]],
                         ids=lambda c: type(c).__name__)
def test_blocked_matches_dense_reference_for_shared_layouts(config):
    layout = config.make_layout(128)
    causal = getattr(config, "attention", "bidirectional") == "unidirectional"
    q, k, v, do = qkv_do(8, (1, 128, 2, 16), jnp.float32)
    check_against_reference(q, k, v, do, layout, causal=causal, impl="blocked")


def test_blocked_memory_grows_linearly_where_xla_grows_with_the_set_blocks():
    """Fixed's global blocks make the set blocks grow as L^2 / window: the gather path stores
    them all, the blocked path one block at a time."""
    config = sparsity.FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2,
                                          attention="unidirectional")

    def temp(seq, impl):
        layout = config.make_layout(seq)
        q = jnp.zeros((1, seq, 2, 16))
        step = jax.jit(jax.grad(lambda q: block_sparse_attention(
            q, q, q, layout, causal=True, impl=impl).sum()))
        return step.lower(q).compile().memory_analysis().temp_size_in_bytes

    blocked = [temp(seq, "blocked") for seq in (512, 2048)]
    xla = [temp(seq, "xla") for seq in (512, 2048)]
    assert blocked[1] / blocked[0] < 6  # 4x the length: linear, plus constants
    assert xla[1] / xla[0] > blocked[1] / blocked[0]


def test_blocked_needs_one_shared_layout():
    layout = random_layout(4, heads=2, nb=4)
    q = jnp.zeros((1, 64, 2, 8))
    with pytest.raises(ValueError, match="shared by every head"):
        block_sparse_attention(q, q, q, layout, impl="blocked")


def test_xla_groups_rows_to_cut_padding():
    """A unidirectional Fixed layout's rows range from 1 to ~nb/4 + 4 blocks: the row groups
    are padded to much less than one group padded to the longest row would be."""
    from jaxspeed.attention import block_sparse

    layout = sparsity.FixedSparsityConfig(
        num_heads=4, block=16, attention="unidirectional").make_layout(2048)
    blocks = check_layout(layout, num_heads=4, seq_len=2048, causal=True)
    plan = block_sparse._plan(blocks.tobytes(), blocks.shape, True, 16)
    assert plan.layout_heads == 1  # the heads share one layout
    rows = np.sort(np.concatenate([np.asarray(plan.order)]))
    np.testing.assert_array_equal(rows, np.arange(128))
    padded = sum(keys.size for keys in plan.keys)
    used = int(blocks[0].sum())
    assert sum(valid.sum() for valid in plan.valid) == used
    assert padded < 1.2 * used < 0.7 * 128 * blocks[0].sum(-1).max()


# ---- both paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "impl,causal",
    [("xla", True), ("pallas", False), *(pytest.param(i, c, marks=pytest.mark.slow)
                                         for i, c in [("xla", False), ("pallas", True)])],
)
def test_dense_layout_equals_dot_product_attention(impl, causal):
    seq, heads, dim = 128, 2, 64  # block and head dim 64: every kernel backend takes them
    q, k, v, _ = qkv_do(5, (2, seq, heads, dim), jnp.float32)
    layout = sparsity.DenseSparsityConfig(num_heads=heads, block=64).make_layout(seq)
    if impl == "pallas" and not _kernel_takes(q, layout):
        pytest.skip("the Mosaic GPU kernel does not take this block, head dim or dtype")
    got = jit(lambda q, k, v: block_sparse_attention(
        q, k, v, layout, causal=causal, impl=impl))(q, k, v)
    want = jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))(q, k, v)
    assert_close(got, want, rtol=attention_rtol(q, backward=False))


def test_auto_is_xla_on_cpu():
    layout = random_layout(6, heads=1, nb=4)
    q, k, v, _ = qkv_do(6, (1, 64, 2, 16), jnp.float32)
    auto = jit(lambda q, k, v: block_sparse_attention(q, k, v, layout))(q, k, v)
    xla = jit(lambda q, k, v: block_sparse_attention(q, k, v, layout, impl="xla"))(q, k, v)
    chex.assert_trees_all_equal(auto, xla)


def test_expand_layout_blocks_and_causal():
    mask = expand_layout(np.array([[[1, 0], [1, 1]]]), seq_len=4, causal=True)
    np.testing.assert_array_equal(
        mask[0], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])


Q = jnp.zeros((1, 64, 2, 16))
BAD_LAYOUTS = {
    "rank": (np.ones((4, 4)), {}, "shape \\[heads, nb, nb\\]"),
    "not square": (np.ones((2, 4, 2)), {}, "shape \\[heads, nb, nb\\]"),
    "head count": (np.ones((3, 4, 4)), {}, "layout has 3 heads but q has 2"),
    "seq not divisible": (np.ones((1, 5, 5)), {}, "seq_len 64 is not divisible"),
    "values": (np.full((1, 4, 4), 2), {}, "only 0 and 1"),
    "empty row": (np.eye(4)[None] * (np.arange(4) != 2)[:, None], {}, "query block 2 has no key"),
    "empty causal row": (np.triu(np.ones((1, 4, 4)), 1) + np.eye(4) * (np.arange(4) > 0),
                         {"causal": True}, "head 0, query block 0 .* on or below the diagonal"),
}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name", list(BAD_LAYOUTS))
def test_bad_layouts_are_clear_errors(name, impl):
    layout, kwargs, message = BAD_LAYOUTS[name]
    with pytest.raises(ValueError, match=message):
        block_sparse_attention(Q, Q, Q, layout, impl=impl, **kwargs)


def test_traced_layout_and_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="concrete array"):
        jax.jit(lambda layout: block_sparse_attention(Q, Q, Q, layout))(jnp.ones((1, 4, 4)))
    with pytest.raises(ValueError, match="impl must be one of"):
        block_sparse_attention(Q, Q, Q, np.ones((1, 4, 4)), impl="triton")
    with pytest.raises(ValueError, match="one shape"):
        block_sparse_attention(Q, Q[:, :32], Q, np.ones((1, 4, 4)))


def test_gpu_benchmark_fallback_layout_is_deepspeed_fixed():
    """benchmarks/gpu_sparse_attention.py builds its layout without jaxspeed when it must."""
    path = ROOT / "benchmarks" / "gpu_sparse_attention.py"
    spec = importlib.util.spec_from_file_location("gpu_sparse_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for seq, block, local in [(8192, 64, 8), (2048, 16, 4), (1024, 64, 4)]:
        config = sparsity.FixedSparsityConfig(
            num_heads=1, block=block, num_local_blocks=local, attention="unidirectional")
        np.testing.assert_array_equal(
            bench.fixed_layout_numpy(seq, block=block, num_local_blocks=local),
            config.make_layout(seq))
