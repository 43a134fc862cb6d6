"""The reference GPT's matmuls: `jnp.einsum`, bf16 operands widened on CPUs without bf16 units.

The GPT's projections, MLP, attention products and head call `einsum` here; the MoE experts and
the blocked and block-sparse attention kernels keep their own dots.

XLA:CPU hands bf16 dots to YNNPACK. Where the CPU multiplies bf16 natively (x86 AVX512-BF16 or
AMX-BF16, Arm's BF16 extension) its bf16 kernels are the fastest. Elsewhere (AVX2, AVX-512
without BF16) YNNPACK widens every operand element inside its inner loop, and its bf16 kernels
run slower than its fp32 ones. Measured on a 2-core AVX2 EPYC with jax 0.12, 8 emulated
devices, `configs/bench_tiny_llama.yaml` (fsdp8, bf16, full remat): 64% of the step's CPU time
was in `ynn::dot_bf16_bf16_fp32_*_avx2_fma3`; with the operands widened first the median step
was 7-10% shorter (four A/B runs, both programs interleaved in one process), same loss.

`einsum` widens only on such a CPU, under XLA:CPU. The result is the same: a bf16 x bf16
product is exact in fp32 and both kernels accumulate in fp32; only the order of the sums may
differ. The dot still returns the dtype the plain einsum would (a bf16 output stays bf16), and
the widened copies are rematerialised (`jax.checkpoint`), so the backward pass keeps the same
bf16 residuals as before under every remat policy: no activation memory is added.

The backward pass's dots are widened too. Autodiff of a dot with a bf16 output hands its
transpose a bf16 cotangent, and XLA ran those dots as bf16 dots again (15 of the 38 dots of the
step above, 39% of its CPU time). `_wide_einsum`'s JVP sums its tangent products in fp32 and
narrows once, so the transposed dots take the fp32 cotangent: another 10% off the median step
(717 -> 643 and 703 -> 632 ms in two A/B runs, both programs interleaved in one process; 799
without widening), all its dots in YNNPACK's fp32 kernels. The forward dot stays an ordinary
`dot_general`, so a `dots` policy still saves its bf16 output (a `custom_vjp` would hide it
inside scanned layers). The cost is scratch: an fp32 cotangent and product at a time, a few
one-layer-sized buffers whatever the depth (+1.5 MiB on that step's 21.4 MiB).

`JAXSPEED_CPU_BF16_MATMUL` overrides the choice: `native` (never widen), `widen` (always, on
CPU), `auto` (the default).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspeed.errors import JaxspeedError
from pallas_kernels.backend import is_cpu

ENV = "JAXSPEED_CPU_BF16_MATMUL"
CHOICES = ("auto", "native", "widen")
#: CPU feature flags (`/proc/cpuinfo`) of matmul units that take bf16 operands: x86
#: AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
BF16_MATMUL_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in `/proc/cpuinfo` text: x86's `flags` lines, Arm's `Features`."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether this host's CPU has bf16 matmul units; True where it cannot tell (no
    `/proc/cpuinfo`), so that an unknown CPU keeps XLA's own choice."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return bool(cpu_flags(text) & BF16_MATMUL_FLAGS)


def widens_bf16() -> bool:
    """Whether `einsum` widens bf16 operands here: in a program compiled for a CPU, as `ENV`
    says (never in one compiled for a GPU, also when that is compiled on a CPU host)."""
    choice = os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise JaxspeedError(f"{ENV} must be one of {CHOICES}, got {choice!r}")
    if choice == "native" or not is_cpu():
        return False
    return choice == "widen" or not cpu_multiplies_bf16()


def einsum(spec: str, *operands: jax.Array, preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, *operands, preferred_element_type=...)`, computed with fp32 operands
    where `widens_bf16()` and an operand is bf16; same result dtype either way."""
    if not (widens_bf16() and any(jnp.dtype(x.dtype) == jnp.bfloat16 for x in operands)):
        return jnp.einsum(spec, *operands, preferred_element_type=preferred_element_type)
    out = preferred_element_type or jnp.result_type(*operands)

    def wide(*xs: jax.Array) -> jax.Array:
        xs = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]
        return _wide_einsum(spec, jnp.dtype(out), *xs)

    # Saving nothing inside: the backward pass widens the bf16 operands again rather than
    # keeping fp32 copies, while an outer `dots` policy still sees (and saves) the dot's output.
    return jax.checkpoint(wide)(*operands)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _wide_einsum(spec: str, out, *xs: jax.Array) -> jax.Array:
    """`jnp.einsum` of fp32 operands into `out`, whose tangent (and so its transpose, the
    backward pass) is computed in fp32."""
    return jnp.einsum(spec, *xs, preferred_element_type=out)


@functools.partial(_wide_einsum.defjvp, symbolic_zeros=True)
def _wide_einsum_jvp(spec, out, primals, tangents):
    # Multilinear: one product per perturbed operand, the others held at their primal values.
    # JAX calls this rule only when some tangent is nonzero.
    terms = [
        jnp.einsum(spec, *primals[:i], t, *primals[i + 1:], preferred_element_type=jnp.float32)
        for i, t in enumerate(tangents)
        if not isinstance(t, jax.custom_derivatives.SymbolicZero)
    ]
    y = jnp.einsum(spec, *primals, preferred_element_type=out)
    return y, functools.reduce(jnp.add, terms).astype(y.dtype)


def logits_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(spec, x, w)` into float32, whose backward dots take a bf16 cotangent.

    The LM head's logits are float32 for the loss, so autodiff hands the head's two backward
    dots a float32 cotangent (`[tokens, vocab]`) and XLA runs them with float32 operands: on a
    GPU at the TF32 rate, half of bf16's. llama_1b's two were 81 ms of a 528 ms step predicted
    for an H100 (benchmarks/README.md, `gpu_mfu.py`). Here they take the cotangent rounded to
    bf16 (Megatron's logits gradient) and still accumulate in float32. Other operand dtypes
    (float32; fp16, whose range a loss-scaled gradient may leave) keep the plain einsum.
    """
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        return einsum(spec, x, w, preferred_element_type=jnp.float32)
    return _narrow_grad_einsum(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _narrow_grad_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return einsum(spec, x, w, preferred_element_type=jnp.float32)


def _narrow_grad_fwd(spec, x, w):
    return _narrow_grad_einsum(spec, x, w), (x, w)


def _narrow_grad_bwd(spec, residuals, g):
    x, w = residuals
    inputs, out = spec.split("->")
    x_spec, w_spec = inputs.split(",")
    g = g.astype(x.dtype)
    dx = einsum(f"{out},{w_spec}->{x_spec}", g, w, preferred_element_type=jnp.float32)
    dw = einsum(f"{x_spec},{out}->{w_spec}", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_narrow_grad_einsum.defvjp(_narrow_grad_fwd, _narrow_grad_bwd)
