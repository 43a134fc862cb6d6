"""`MoE`: a mixture-of-experts FFN layer for Flax Linen, with DeepSpeed-MoE's options.

Router + `E` expert FFNs (+ optional PR-MoE residual FFN and shared experts). Gating runs per
token group (GShard), and under a mesh with an `expert` axis the experts are expert-parallel
(see `jaxspeed.moe.parallel`). The layer records its (coefficient-scaled) aux loss + z-loss as
one scalar in the `AUX_LOSS` collection, which the engine adds to the training loss, and
routing statistics in `METRICS`.

Parameters carry Flax logical partitioning metadata: experts `("expert", "embed", "mlp")` /
`("expert", "mlp", "embed")`, dense FFNs `("embed", "mlp")` / `("mlp", "embed")`, the router
`("embed", None)`. Model code never names mesh axes; the planner maps `expert` to the `expert`
mesh axis and `mlp` to `tensor`, and ZeRO shards expert weights over `data` only and the rest
over (`data`, `expert`).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspeed.errors import ConfigError
# AUX_LOSS: one already-scaled scalar per MoE call, under "moe"
from jaxspeed.ops.losses import AUX_LOSS, STEP_METRICS
from jaxspeed.moe.balance import BIAS_PARAM
from jaxspeed.moe.experts import ExpertParams, expert_ffn
from jaxspeed.moe.options import GatingOptions
from jaxspeed.moe.parallel import moe_ffn
from jaxspeed.moe.strategies import STRATEGIES, Links
from jaxspeed.options.moe import MoeOptions, option_errors

#: Flax collection of routing metrics: "dropped_fraction", "expert_counts", "balance_loss"
#: (Flax's own `sow` default, which trainers leave immutable).
METRICS = "intermediates"
#: The rng stream for noisy gates and random token selection.
GATING_RNG = "gating"


def _normal(fan_in: int):
    return nn.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


def _dense_ffn(x, w_in, w_out, w_gate, activation, fp8=None):
    """One FFN `[T, M] -> [T, M]` with `expert_ffn`'s numerics (fp32 accumulate/activation)."""
    params = ExpertParams(w_in[None], w_out[None], None if w_gate is None else w_gate[None])
    return expert_ffn(x[None], params, activation=activation, fp8=fp8)[0]


def _links(cluster: Any) -> Links | None:
    if isinstance(cluster, str):
        raise ConfigError(
            f"MoE.cluster={cluster!r} is a file or preset name, which the GPT's builder reads "
            f"(`model.moe.cluster`); a layer of your own takes its links: "
            f"cluster=jaxspeed.moe.strategies.links_of(jaxspeed.config.cluster."
            f"load_cluster({cluster!r}))")
    return cluster


def check_options(options: Any) -> None:
    """Raises one ConfigError naming every error of `option_errors`, and a cluster that is
    neither a name (a config's) nor `Links` (the layer's)."""
    errors = option_errors(options)
    if not (options.cluster is None or isinstance(options.cluster, (str, Links))):
        errors.append(f"MoE.cluster must be a cluster file or preset name (a config), or "
                      f"jaxspeed.moe.strategies.Links (the layer), got {options.cluster!r}")
    if errors:
        raise ConfigError("; ".join(errors))


class MoE(MoeOptions, nn.Module):
    """Mixture-of-experts FFN (GShard / DeepSpeed-MoE / Tutel), expert-parallel on a mesh.

    `y = sum_j w_tj * expert_{e_tj}(x_t)` over each token's kept top-k choices, plus the
    PR-MoE residual mix and shared experts when enabled.

    Randomness (`use_rts` with drops, `gate_noise`, `noisy_gate_policy`) draws from the
    "gating" rng stream when `deterministic=False`; without one the call raises (the defaults
    use RTS, so training and `init` need `rngs={"gating": key}`, or `deterministic=True`).
    Group `g` uses `fold_in(key, g)`, so the draws do not depend on the device layout.

    Attributes:
      num_experts: `E`.
      d_ff: hidden size `H` of each expert (and of the residual / each shared FFN).
      k: choices per token.
      capacity_factor: training capacity `max(ceil(k * cf * Tg / E), min_capacity)` per
        group of `Tg` tokens; must be > 0 with `drop_tokens`. With `dynamic_capacity` it is
        the cap.
      dynamic_capacity: Tutel's dynamic capacity (its negative `capacity_factor`), as an
        explicit switch: while training, each step uses the smallest of up to 4 static
        capacities (the cap, cap/2, cap/4, cap/8, rounded up to 8) that holds the busiest
        expert of every group, so nothing is dropped below the cap and the buffers and
        expert FLOPs follow the load. Cost: one compiled branch per capacity (`lax.switch`;
        compile time and program size grow about 4x for the expert part) and a second gating
        pass; under expert parallelism, one scalar `pmax` so all devices pick the same one.
      eval_capacity_factor: the factor with `deterministic=True`.
      min_capacity: lower bound of the capacity.
      noisy_gate_policy: None, "Jitter" or "RSample" (DeepSpeed).
      drop_tokens: False = dropless. Without expert parallelism the experts run as grouped
        matmuls (`dropless_ffn`, no padding). Under expert parallelism the capacity becomes
        the group's token count `Tg`, so the all-to-all buffers are `[E, Tg, M]` per group
        (`E / k` times the tokens' size) and the expert FLOPs grow the same way.
      use_rts: DeepSpeed's random token selection (slot order random); needs the "gating"
        rng when training with `drop_tokens` (without drops it changes nothing and is off).
      use_residual: PR-MoE (Rajbhandari et al. 2022): a dense FFN beside the experts, mixed
        by a learned softmax coefficient `softmax(x @ W_c + b_c)` over (moe, dense).
      num_shared_experts: dense FFNs always applied and added to the output (DeepSeekMoE),
        stored fused as one FFN of hidden size `num_shared_experts * d_ff` (same math).
      activation: "relu", "gelu" (exact) or "swiglu".
      aux_loss_coef: coefficient of GShard's balance loss in the sown aux loss (with
        `balance="bias"` none is added; the balance loss is still logged in `METRICS`).
      balance: "aux_loss" (GShard's loss) or "bias": DeepSeek-V3's per-expert bias on the
        scores that pick the experts (`jaxspeed.moe.balance`), a param `selection_bias [E]`
        whose cotangent is the step's expert load. The optimizer must move it by the sign
        rule: wrap it with `jaxspeed.moe.balance.with_bias_update(tx, rate)` (the engine
        does, with `model.moe.bias_update_rate`); a plain optimizer would treat the load as
        a gradient.
      routing: "token_choice" (each token picks its top-k experts) or "expert_choice" (each
        expert picks its top-`C` tokens of the group, Zhou et al. 2022,
        `jaxspeed.moe.expert_choice`); `C` is the capacity `k * capacity_factor * Tg / E`.
        Not causal: a token's experts depend on later tokens of its group.
      a2a_chunks: under expert parallelism, the capacity buffer goes to the experts in this
        many chunks, each its own all-to-all, FFN and all-to-all back, so chunk i+1's exchange
        can overlap chunk i's FFN where collectives run asynchronously (XLA:GPU); the same
        result as 1. "auto": up to 4 chunks of at least 256 KiB each, 1 on CPU devices
        (`jaxspeed.moe.all_to_all.a2a_chunk_count`).
      all_to_all: "flat" or "hierarchical" (Tutel's 2D all-to-all,
        `jaxspeed.moe.all_to_all`): inside each host first, then across hosts with one
        message per device and host pair, so a slow link carries fewer, larger messages.
        Where a device's tokens are fewer bytes than its slots for one host, the tokens go
        across instead (`jaxspeed.moe.host_tokens`). The same result as "flat".
      a2a_hosts: the hosts the expert axis spans, for "hierarchical" and the parallelism
        strategies; None: the processes its devices belong to (an int emulates hosts within
        one process).
      parallelism: what moves over the expert axis (Tutel's adaptive parallelism,
        `jaxspeed.moe.strategies`), from the same stored experts: "expert" (the tokens, by
        all-to-all), "data" (every expert's weights, gathered; the tokens stay),
        "expert_data" (the weights across hosts, the tokens inside each host),
        "expert_tensor" (the tokens by all-to-all, each expert's hidden units left split over
        the `tensor` mesh axis; the others gather them there and split the slots), or "auto":
        per capacity (per step with `dynamic_capacity`), the cheapest by the cost model on
        `cluster`'s links, logged (logger `jaxspeed.moe.strategies`) once per capacity at
        compile time; each step sows which one ran (`moe_auto_<strategy>`: 1 for the one
        that ran) into `STEP_METRICS`, which the engine logs. The same result.
      cluster: the links `parallelism="auto"` prices the strategies on: a cluster's
        (`jaxspeed.moe.strategies.links_of(jaxspeed.config.cluster.load_cluster(spec))`);
        None: every byte costs the same. In a config, `model.moe.cluster` is a cluster file
        (`jaxspeed calibrate`'s output) or preset name, which the GPT's builder reads.
      z_loss_coef: coefficient of the router z-loss (ST-MoE).
      gate_noise: Tutel's gate noise std (times 1/E) on the logits.
      bpr: batch-prioritized routing (Tutel).
      normalize_gate: renormalize the kept top-k weights (k > 1), after drops.
      impl: dispatch/combine implementation: "auto", "pallas" or "xla".
      num_groups: token groups gated separately; None = the data-parallel size of the mesh.
      expert_axis: the mesh axis the experts are sharded over.
      param_dtype: dtype the params are created in.
      dtype: compute dtype of the experts; None = the dtype the expert params arrive in. The
        router always computes in fp32. The output has `x`'s dtype.
      fp8: None, or the FP8 recipe of the experts' (and the shared and residual FFNs')
        matmuls: `tensorwise` or `rowwise` (`jaxspeed.ops.fp8`).
    """

    expert_axis: str = "expert"
    param_dtype: Any = jnp.float32
    dtype: Any = None
    fp8: str | None = None

    def _param(self, name, names, shape, fan_in):
        init = nn.with_logical_partitioning(_normal(fan_in), names)
        if names[:1] == ("expert",) and not self.is_initializing():
            # Inside a step's map manual over the expert axis (the explicit ZeRO-3 step) the
            # stored experts are this worker's `[E / ep, ...]`, where Flax expects all `E`.
            own = nn.meta.unbox(self.get_variable("params", name))
            if (own is not None and own.shape[1:] == shape[1:]
                    and shape[0] % own.shape[0] == 0):
                return own
        return self.param(name, init, shape, self.param_dtype)

    def _ffn_params(self, prefix, width, hidden, fan_hidden, *, expert: bool):
        lead = ("expert",) if expert else ()
        lead_shape = (self.num_experts,) if expert else ()
        w_in = self._param(f"{prefix}w_in", lead + ("embed", "mlp"),
                           lead_shape + (width, hidden), width)
        w_out = self._param(f"{prefix}w_out", lead + ("mlp", "embed"),
                            lead_shape + (hidden, width), fan_hidden)
        w_gate = None
        if self.activation == "swiglu":
            w_gate = self._param(f"{prefix}w_gate", lead + ("embed", "mlp"),
                                 lead_shape + (width, hidden), width)
        return w_in, w_out, w_gate

    def _gating_rng(self, opts: GatingOptions):
        if not opts.needs_rng:
            return None
        if not self.has_rng(GATING_RNG):
            raise ValueError(
                f"MoE with {', '.join(opts.random_features)} needs a {GATING_RNG!r} rng when "
                f"deterministic=False: pass rngs={{'{GATING_RNG}': key}} to apply/init, or "
                f"call with deterministic=True")
        return self.make_rng(GATING_RNG)

    @nn.compact
    def __call__(self, x, *, deterministic: bool = False):
        """Applies the MoE FFN.

        Args:
          x: `[batch, length, embed]` or `[tokens, embed]`.
          deterministic: eval mode: `eval_capacity_factor`, no noise, no random order.

        Returns:
          `x`'s shape and dtype.
        """
        check_options(self)
        if x.ndim not in (2, 3):
            raise ValueError(
                f"MoE input must be [batch, length, embed] or [tokens, embed], got {x.shape}")
        width = x.shape[-1]
        tokens = x.reshape(-1, width)
        gate_kernel = self._param("gate_kernel", ("embed", None), (width, self.num_experts),
                                  width)
        experts = ExpertParams(*self._ffn_params("expert_", width, self.d_ff, self.d_ff,
                                                 expert=True))
        dtype = self.dtype or experts.w_in.dtype
        h = tokens.astype(dtype)
        opts = GatingOptions(
            num_experts=self.num_experts, k=self.k, capacity_factor=self.capacity_factor,
            eval_capacity_factor=self.eval_capacity_factor, min_capacity=self.min_capacity,
            noisy_gate_policy=None if self.noisy_gate_policy == "None"
            else self.noisy_gate_policy,
            drop_tokens=self.drop_tokens, use_rts=self.use_rts, gate_noise=self.gate_noise,
            bpr=self.bpr, normalize_gate=self.normalize_gate, z_loss_coef=self.z_loss_coef,
            activation=self.activation, impl=self.impl, eval_mode=deterministic,
            dynamic_capacity=self.dynamic_capacity, routing=self.routing,
            a2a_chunks=self.a2a_chunks, all_to_all=self.all_to_all, a2a_hosts=self.a2a_hosts,
            parallelism=self.parallelism, cluster=_links(self.cluster), fp8=self.fp8)
        bias = None
        if self.balance == "bias":
            bias = self.param(BIAS_PARAM, nn.with_logical_partitioning(nn.initializers.zeros,
                                                                       (None,)),
                              (self.num_experts,), jnp.float32)
        out = moe_ffn(h, gate_kernel, experts, opts=opts, num_groups=self.num_groups,
                      rng=self._gating_rng(opts), expert_axis=self.expert_axis,
                      selection_bias=bias)
        y = out.y.astype(jnp.float32)

        if self.use_residual:
            dense = _dense_ffn(h, *self._ffn_params("residual_", width, self.d_ff, self.d_ff,
                                                    expert=False), self.activation, self.fp8)
            coef_kernel = self._param("residual_coef_kernel", ("embed", None), (width, 2), width)
            coef_bias = self.param(
                "residual_coef_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                   (None,)),
                (2,), self.param_dtype)
            logits = jnp.dot(h.astype(jnp.float32), coef_kernel.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST)
            coef = jax.nn.softmax(logits + coef_bias.astype(jnp.float32), axis=-1)
            y = y * coef[:, :1] + dense.astype(jnp.float32) * coef[:, 1:]
        if self.num_shared_experts:
            hidden = self.num_shared_experts * self.d_ff
            shared = _dense_ffn(h, *self._ffn_params("shared_", width, hidden, self.d_ff,
                                                     expert=False), self.activation, self.fp8)
            y = y + shared.astype(jnp.float32)

        balance = jnp.mean(out.aux_loss)
        aux_coef = self.aux_loss_coef if self.balance == "aux_loss" else 0.0
        self.sow(AUX_LOSS, "moe", aux_coef * balance + jnp.mean(out.z_loss))
        self.sow(METRICS, "balance_loss", balance)
        self.sow(METRICS, "dropped_fraction", jnp.mean(out.dropped_fraction))
        self.sow(METRICS, "expert_counts", jnp.sum(out.expert_counts, axis=0))
        if self.parallelism == "auto":  # what ran this step; the engine logs the sums
            for name, share in zip(STRATEGIES, jnp.mean(out.strategy, axis=0)):
                self.sow(STEP_METRICS, f"moe_auto_{name}", share)
        return y.astype(x.dtype).reshape(x.shape)
