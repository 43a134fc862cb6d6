"""Tolerances for comparing two programs that compute the same math in a different order.

Another mesh, another ZeRO stage, a pipeline, a kernel, XLA's fusion at another optimisation
level, or another CPU's vector width all add the same floats in another order. Such programs
agree only up to rounding, and how far is a property of the arithmetic, not of the machine the
test was first run on. The tolerances here come from one stated model:

1. **A reordered sum** (Higham & Mary, "A new approach to probabilistic rounding error
   analysis", SISC 2019, Thm 2.4). Rounding errors of a sum of `n` terms behave as independent,
   mean-zero variables, so with probability at least `1 - 2 exp(-LAMBDA**2 / 2)` the computed
   sum is within `LAMBDA * sqrt(n) * u * sum|terms|` of the exact one (`u`: the unit roundoff,
   2**-24 for fp32). Two programs are each that close, so they agree to twice it. LAMBDA = 6
   makes a miss a one-in-10**8 event per sum; the worst case, `n * u`, is reached only by
   adversarial inputs and would hide real bugs in the tests' small models.
2. **A chain of reductions.** A forward and backward pass chains `depth` reductions (matmuls,
   softmax and norm sums, the loss mean), each of at most `width` terms. To first order their
   rounding errors add, and being independent they add as one sum of `depth * width` roundings
   would: two whole programs agree to `2 * LAMBDA * sqrt(depth * width) * u`, relative to the
   magnitudes involved. Those are taken as the largest magnitude of the compared array: the
   terms of a sum are no larger than the values they produce, up to the conditioning of the
   model, which is benign in these tests (but for Adam's constants, point 3, and values that
   cancel their terms, such as a compression's error, compared at the terms' magnitude). So
   the comparison is elementwise with `atol = rtol * max|want|`.
3. **Adam** magnifies a gradient's relative error where the gradient itself is at rounding
   level: its step `lr * m / (sqrt(v) + eps)` does not depend on the gradient's scale, so there
   a step can flip by up to `2 * lr`, while elsewhere a relative gradient error `rho` moves it
   by about `rho * lr`. Coordinates with `|g| < rho * max|g|` are a fraction of about `4 * rho`
   of a leaf (a bell-shaped gradient's largest value is ~4 standard deviations), so each leaf's
   params are compared in norm after `steps` steps, `N` values a leaf:
   `|p - p_ref|_2 <= steps * lr * sqrt(N) * (rho + 2 * sqrt(4 * rho))`.
   Against a float64 oracle Adam's constants add to `rho`: `b1` and `b2` round to fp32
   (relative `u`) and the bias corrections `1 - b**t` magnify that up to `b / (1 - b)` times
   (999 for `b2 = 0.999`), which the update reads through `m_hat` and `sqrt(v_hat)`
   (`adam_constants_rtol`).
4. **Low-precision compute.** Matmuls with bf16/fp16 operands accumulate in fp32 (the
   kernels ask for it; XLA's CPU and GPU dots do it), so their sums round as point 2 says in
   fp32. The low precision enters where a value is cast to bf16/fp16 (an input, a matmul's
   output, the probabilities before `p @ v`): one rounding of each term, a reduction of width 1
   in that dtype. `casts` such roundings chained from the inputs to the compared value add, as
   point 2, to `sum_rtol(casts, dtype)` on top of the fp32 program's rtol (`mixed_rtol`).

5. **Muon** orthogonalizes each weight matrix's momentum with a Newton–Schulz iteration, which
   magnifies a relative error of its input by up to `newton_schulz_gain`: a derivative bound
   from the input's singular values, or `2 * 3.4445**5` (~1000) for the worst input. Its update
   is otherwise a fixed multiple of the result (`muon_params_atol`).

Exact equality stays where two programs are the same program (a resume, the same mesh).
"""

from __future__ import annotations

import math

import chex
import jax
import numpy as np

#: Confidence multiplier of the probabilistic bound (miss probability ~ 2 exp(-18) per sum).
LAMBDA = 6.0

#: Unit roundoff per dtype name.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float64": 2.0**-53}


def sum_rtol(n: int, dtype: str = "float32") -> float:
    """Relative distance (of `sum|terms|`) between two orders of one sum of `n` terms."""
    return 2.0 * LAMBDA * math.sqrt(max(n, 1)) * UNIT_ROUNDOFF[str(np.dtype(dtype))]


def program_rtol(*, width: int, depth: int, dtype: str = "float32") -> float:
    """Relative distance between two orders of a program of `depth` chained reductions.

    Args:
      width: the number of terms of the program's widest reduction (a matmul's contraction, the
        tokens a weight gradient or the loss sums over).
      depth: how many reductions are chained from the inputs to the compared value.
      dtype: the dtype the sums accumulate in.
    """
    return sum_rtol(depth * width, dtype)


def assert_close(got, want, *, rtol: float) -> None:
    """Elementwise `|got - want| <= rtol * (|want| + max|want|)`, leaf by leaf."""

    def check(a, e):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = float(np.abs(e).max()) if e.size else 0.0
        chex.assert_trees_all_close(a, e, rtol=rtol, atol=rtol * scale)

    jax.tree.map(check, jax.device_get(got), jax.device_get(want))


def adam_params_atol(*, steps: int, lr: float, rho: float, size: int) -> float:
    """Bound on `|p - p_ref|_2` of one leaf of `size` values after `steps` Adam steps at `lr`,
    when the two runs' gradients differ by a relative `rho` (model point 3)."""
    return steps * lr * math.sqrt(size) * (rho + 2.0 * math.sqrt(4.0 * rho))


def assert_adam_params_close(got, want, *, steps: int, lr: float, rho: float) -> None:
    """Each leaf of `got` is within `adam_params_atol` of `want`, in the 2-norm."""

    def check(path, a, e):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        err = float(np.linalg.norm(a - e))
        bound = adam_params_atol(steps=steps, lr=lr, rho=rho, size=e.size)
        assert err <= bound, (
            f"{jax.tree_util.keystr(path)}: |params - reference|_2 = {err:.3g} > {bound:.3g} "
            f"(steps={steps}, lr={lr}, rho={rho:.3g}, size={e.size})"
        )

    jax.tree_util.tree_map_with_path(check, jax.device_get(got), jax.device_get(want))


def adam_constants_rtol(*, b1: float, b2: float) -> float:
    """Relative error of an fp32 Adam update against a float64 oracle from rounding `b1` and
    `b2` to fp32: `1 - b**t` magnifies it by at most `b / (1 - b)` (at `t = 1`); the update is
    proportional to `m_hat` and to `1 / sqrt(v_hat)` (model point 3)."""
    return (b1 / (1 - b1) + 0.5 * b2 / (1 - b2)) * UNIT_ROUNDOFF["float32"]


def gpt_rtol(*, tokens: int, d_model: int, d_ff: int, n_layers: int, vocab: int) -> float:
    """`program_rtol` of a reference GPT's loss and gradients on `tokens` tokens per step.

    Width: the widest sum (a weight gradient and the loss mean over the tokens, a matmul over
    `d_ff`, the softmax over `vocab`). Depth: per layer, 8 reductions forward (2 norms, qkv,
    scores, softmax, context, out-projection, the MLP's two matmuls counted as one chain with
    its activation), plus the embedding, final norm, head and loss; the backward pass chains
    two more products per forward reduction.
    """
    return program_rtol(width=max(tokens, d_model, d_ff, vocab), depth=3 * (8 * n_layers + 4))


def mixed_rtol(*, width: int, depth: int, casts: int, dtype: str) -> float:
    """`program_rtol` of an fp32-accumulating program whose values are rounded to `dtype`
    (bf16/fp16) `casts` times on the chain from its inputs to the compared value (model point 4).

    Args:
      width, depth: the fp32 sums, as for `program_rtol`.
      casts: the roundings to `dtype` on the way (inputs, outputs of ops computed in `dtype`).
      dtype: the low-precision dtype.
    """
    return program_rtol(width=width, depth=depth) + sum_rtol(casts, dtype)



#: Muon's quintic Newton–Schulz coefficients (`jaxspeed.optim.muon.NS_COEFFS`).
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz_gain(singular_values=None, *, steps: int = 5) -> float:
    """How much Muon's Newton–Schulz magnifies a perturbation of its input, relative to the
    input's Frobenius norm (model point 5).

    The input is first scaled to unit norm, which at most doubles a relative error. Then the
    iteration applies `f`, `steps` compositions of `p(s) = a s + b s^3 + c s^5`, to the singular
    values. To first order a spectral function moves by at most the largest of `|f'|` between
    the smallest and the largest singular value (divided differences, by the mean value
    theorem) and `f(s) / s` at each one (a rectangular matrix's extra directions). Given the
    input's `singular_values` that is computed on them; without, the worst case over all inputs
    is `f'(0) = a**steps` (`b < 0` makes `|p'|` largest at 0).
    """
    a, b, c = NS_COEFFS
    if singular_values is None:
        return 2.0 * a**steps
    s = np.asarray(singular_values, np.float64)
    s = s / np.linalg.norm(s)
    x = np.concatenate([np.linspace(s.min(), s.max(), 2001), s])
    slope = np.ones_like(x)
    for _ in range(steps):
        slope *= a + 3 * b * x**2 + 5 * c * x**4
        x = a * x + b * x**3 + c * x**5
    ratio = x[-len(s):] / np.maximum(s, 1e-30)
    return 2.0 * float(max(np.abs(slope).max(), ratio.max()))


def muon_params_atol(*, steps: int, lr: float, rho: float, stack: int, fan_in: int,
                     fan_out: int, gain: float, rms_scale: float = 0.2, ns_steps: int = 5) -> float:
    """Bound on `|p - p_ref|_2` of one Muon-updated leaf (`stack` matrices of `fan_in x fan_out`)
    after `steps` steps, when the runs' gradients differ by a relative `rho` (model point 5).

    Relative to their Frobenius norm the gradients differ by `4 * rho` (a bell-shaped
    gradient's largest value is ~4 standard deviations, as in point 3); the iteration's
    `3 * ns_steps` chained matmuls add their own rounding. `gain` (`newton_schulz_gain`)
    magnifies both into the orthogonalized matrix, whose update is that times
    `lr * rms_scale * sqrt(max(fan_in, fan_out))`; the stack's matrices add in quadrature.
    """
    width = max(fan_in, fan_out)
    error = gain * (4.0 * rho + program_rtol(width=width, depth=3 * ns_steps))
    return steps * lr * rms_scale * math.sqrt(stack * width) * error
