"""The chunked MoE all-to-all as XLA:GPU schedules it, compiled for 8 H100s without a GPU:
the exchanges are asynchronous (`all-to-all-start` ... `-done`) and, chunked, the expert
FFN's matmuls of one chunk run inside another chunk's exchange."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gpu_compile import needs_gpu_compile
from jaxspeed.moe.layer import MoE
from jaxspeed.sharding.planner import plan_sharding

TOKENS, WIDTH = 8 * 256, 512
_START = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? all-to-all-start\(")
_DONE = re.compile(r" all-to-all-done\([^%]*%([^\s),]+)")
_MATMUL = re.compile(r"gemm|cublas|= \S+ dot\(")


def matmuls_inside_exchanges(hlo: str) -> tuple[int, int]:
    """(asynchronous all-to-alls, matmuls scheduled between an all-to-all's start and done,
    each counted once per exchange it is inside) in the entry computation's order."""
    entry = hlo[hlo.index("ENTRY"):]
    open_windows: dict[str, int] = {}
    starts = inside = 0
    for line in entry.splitlines():
        if (start := _START.match(line)):
            open_windows[start.group(1)] = 0
            starts += 1
        elif (done := _DONE.search(line)):
            inside += open_windows.pop(done.group(1), 0)
        elif " = " in line and _MATMUL.search(line):
            for name in open_windows:
                open_windows[name] += 1
    return starts, inside


def _compile(chunks: int, axes=(("expert", 8),), **options) -> str:
    from jaxspeed.gpu import deviceless

    devices = deviceless.devices("h100", 8)
    names, sizes = tuple(a for a, _ in axes), tuple(n for _, n in axes)
    mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
    module = MoE(**{**dict(num_experts=8, d_ff=1024, k=2, capacity_factor=1.0, use_rts=False,
                           a2a_chunks=chunks), **options})
    tokens = jnp.zeros((TOKENS, WIDTH), jnp.bfloat16)
    boxed = jax.eval_shape(lambda: module.init({"params": jax.random.key(0)}, tokens,
                                               deterministic=True))
    shapes = nn.unbox(boxed)["params"]
    with jax.set_mesh(mesh):
        plan = plan_sharding(shapes, nn.get_partition_spec(boxed)["params"], mesh, stage=0)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              shapes, plan.params)
        x = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                                 sharding=NamedSharding(mesh, P("expert")))

        def loss(p, x):
            # Not linear in `y`: its cotangent, so the backward's exchanges, comes after the
            # forward, as in a model. With `sum(y)` the backward's exchanges need only the routing,
            # and XLA:GPU (jax 0.12.1) schedules them inside the forward, among its chunks.
            y = module.apply({"params": p}, x, deterministic=True)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        with jax.default_device(devices[0]):
            return jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()


@needs_gpu_compile
@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_exchanges_overlap_the_expert_matmuls(chunks):
    starts, inside = matmuls_inside_exchanges(_compile(1))
    assert starts >= 2  # XLA:GPU runs the all-to-alls asynchronously ...
    chunked_starts, chunked_inside = matmuls_inside_exchanges(_compile(chunks))
    assert chunked_starts > starts  # ... more of them chunked ...
    assert chunked_inside > inside + chunks  # ... with other chunks' matmuls inside them


def _permutes_int32(hlo: str) -> bool:
    """Whether a collective-permute (alone or in a tuple XLA:GPU combined) moves int32."""
    return any("s32[" in line.split(" collective-permute")[0]
               for line in hlo.splitlines() if re.search(r" collective-permute(-start)?\(", line))


@needs_gpu_compile
def test_the_token_exchange_lowers_for_gpus_and_chunks_keep_the_slots():
    """The hierarchical exchange over 2 emulated hosts of 4 H100s (top-2 at eval capacity
    factor 1.25: a device's tokens are fewer bytes than its slots for the other host): unchunked,
    the tokens cross with their int32 slots, dispatched on the other side by the GPU kernels;
    in 2 chunks, which XLA:GPU overlaps with the FFN, the slots cross and no int32 does."""
    options = dict(all_to_all="hierarchical", a2a_hosts=2, eval_capacity_factor=1.25)
    assert _permutes_int32(_compile(1, **options))
    assert not _permutes_int32(_compile(2, **options))


@needs_gpu_compile
@pytest.mark.parametrize("parallelism", ["expert", "expert_tensor"])
def test_both_sharding_degrees_lower_for_gpus(parallelism):
    """expert x tensor = 4 x 2 H100s: the experts run whole (their hidden units gathered over
    `tensor`) or split, both asynchronous all-to-alls on the GPU."""
    hlo = _compile(1, axes=(("expert", 4), ("tensor", 2)), parallelism=parallelism)
    assert re.search(r" all-to-all-start\(", hlo)
    assert bool(re.search(r" all-gather(-start)?\(", hlo)) == (parallelism == "expert")
