"""Load balancing without an auxiliary loss (DeepSeek-V3, Wang et al. 2024): a per-expert bias
added to the routing scores for the choice of experts only, moved after each step by a sign
rule, `b_e += rate * sign(mean load - load_e)`.

The bias is a parameter of the MoE layer (`BIAS_PARAM`, `[E]`, fp32 zeros at init), so it lives
in the train state: it is checkpointed, restored and resharded with the params. Its update is
not a gradient step. The layer reports the step's expert load as the bias's cotangent
(`report_load`), so the engine's own gradient path sums it over devices, micro-batches and
token groups like any gradient; `with_bias_update` gives the bias leaves their own optax
transform (`optax.partition`): the sign rule, with no clipping, weight decay or moments, while
every other leaf gets the optimizer as before (its global-norm clipping never sees the bias).
The weights that mix the chosen experts' outputs stay the router's unbiased probabilities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxspeed.tree_paths import key_names

#: The MoE layer's bias parameter (`model.moe.balance: bias`).
BIAS_PARAM = "selection_bias"
_TRAIN, _BIAS = "optimizer", "bias_sign_rule"


@jax.custom_vjp
def report_load(y, bias, load):
    """Returns `y`. In the backward pass `y`'s cotangent passes through and `load` (the same
    shape and dtype as `bias`) becomes `bias`'s cotangent."""
    del bias, load
    return y


def _report_fwd(y, bias, load):
    del bias
    return y, load


def _report_bwd(load, cotangent):
    return cotangent, load, jnp.zeros_like(load)


report_load.defvjp(_report_fwd, _report_bwd)


def centered_load(expert_counts: jax.Array) -> jax.Array:
    """Each expert's share of the routed choices less the mean share `1/E`, fp32 `[E]`, from
    counts `[..., E]` (summed over the leading axes). Positive: overloaded.

    Shares rather than counts, so every device and micro-batch weighs the same and the summed
    cotangent stays small beside the real gradients in the logged `grad_norm`; centred, so a
    sum over devices has the sign of the global overload.
    """
    counts = jnp.sum(expert_counts.reshape(-1, expert_counts.shape[-1]), axis=0)
    share = counts.astype(jnp.float32) / jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)
    return share - 1.0 / counts.shape[0]


def bias_sign_rule(rate: float) -> optax.GradientTransformation:
    """DeepSeek-V3's update from the reported load `g` (`centered_load`, summed): `-rate * sign(g)`."""
    return optax.chain(optax.scale_by_sign(), optax.scale(-rate))


def is_bias(path) -> bool:
    """Whether a params key path is a MoE layer's selection bias."""
    names = key_names(path)
    return bool(names) and names[-1] == BIAS_PARAM


def with_bias_update(tx: optax.GradientTransformation, rate: float) -> optax.GradientTransformation:
    """`tx` for every param except the selection biases, which move by `bias_sign_rule(rate)`."""

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: _BIAS if is_bias(path) else _TRAIN, params)

    return optax.partition({_TRAIN: tx, _BIAS: bias_sign_rule(rate)}, labels)
