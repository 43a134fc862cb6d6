"""The MoE layer's options (`jaxspeed.moe.MoE`'s fields a config sets), the values each named
option takes, and their checks. Plain data: `jaxspeed.config` types `model.moe` from it
without loading JAX."""

from __future__ import annotations

import dataclasses
from typing import Any

#: `noisy_gate_policy` values (DeepSpeed's names; the string "None" means None).
NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
#: `activation` values.
ACTIVATIONS = ("relu", "gelu", "swiglu")
#: `balance` values.
BALANCES = ("aux_loss", "bias")
#: `routing` values.
ROUTINGS = ("token_choice", "expert_choice")
#: `all_to_all` values.
ALGORITHMS = ("flat", "hierarchical")
#: `parallelism` values (`jaxspeed.moe.strategies`; `auto` chooses among the others).
PARALLELISMS = ("expert", "data", "expert_data", "expert_tensor", "auto")
#: `impl` values: how dispatch and combine run (`jaxspeed.moe.dispatch`).
IMPLS = ("auto", "pallas", "xla")


@dataclasses.dataclass
class MoeOptions:
    """The options of an MoE layer, as `jaxspeed.moe.MoE` documents them (the layer adds the
    mesh axis, the dtypes and the FP8 recipe, which a config does not set directly)."""

    num_experts: int
    d_ff: int
    k: int = 1
    capacity_factor: float = 1.0
    dynamic_capacity: bool = False
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    use_residual: bool = False
    num_shared_experts: int = 0
    activation: str = "gelu"
    aux_loss_coef: float = 0.01
    balance: str = "aux_loss"
    routing: str = "token_choice"
    a2a_chunks: int | str = 1
    all_to_all: str = "flat"
    a2a_hosts: int | None = None
    parallelism: str = "expert"
    #: a config's str (file or preset), which the model builder reads; the layer's `Links`
    cluster: Any = None
    z_loss_coef: float = 0.0
    gate_noise: float = 0.0
    bpr: bool = False
    normalize_gate: bool = True
    impl: str = "auto"
    num_groups: int | None = None


def option_errors(options: Any) -> list[str]:
    """Every way MoE `options` do not go together, one message each (`options`: anything with
    `MoE`'s attributes: the layer itself, or a validated `model.moe` config)."""
    errors = []

    def positive_int(name, value, low=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            errors.append(f"MoE.{name} must be an int >= {low}, got {value!r}")

    def one_of(name, choices):
        if getattr(options, name) not in choices:
            errors.append(f"MoE.{name} must be one of {choices}, got {getattr(options, name)!r}")

    positive_int("num_experts", options.num_experts)
    positive_int("d_ff", options.d_ff)
    positive_int("k", options.k)
    positive_int("min_capacity", options.min_capacity, 0)
    positive_int("num_shared_experts", options.num_shared_experts, 0)
    counts = (options.k, options.num_experts)
    if all(isinstance(n, int) and not isinstance(n, bool) for n in counts) and counts[0] > counts[1]:
        errors.append(f"MoE.k must be <= num_experts={options.num_experts}, got k={options.k}")
    if options.drop_tokens and not options.capacity_factor > 0:
        errors.append(
            f"MoE.capacity_factor must be > 0 with drop_tokens=True, got "
            f"{options.capacity_factor}; use drop_tokens=False for dropless experts")
    if options.drop_tokens and not options.eval_capacity_factor > 0:
        errors.append(
            f"MoE.eval_capacity_factor must be > 0 with drop_tokens=True, got "
            f"{options.eval_capacity_factor}")
    one_of("noisy_gate_policy", NOISY_GATE_POLICIES + ("None",))
    one_of("activation", ACTIVATIONS)
    if options.gate_noise < 0:
        errors.append(f"MoE.gate_noise must be >= 0, got {options.gate_noise}")
    if options.use_rts and options.bpr and options.drop_tokens:
        errors.append("MoE.use_rts and MoE.bpr both set the slot order: set at most one to True")
    one_of("balance", BALANCES)
    one_of("routing", ROUTINGS)
    one_of("all_to_all", ALGORITHMS)
    if options.a2a_hosts is not None:
        positive_int("a2a_hosts", options.a2a_hosts)
    one_of("parallelism", PARALLELISMS)
    chunks = options.a2a_chunks
    if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        errors.append(f"MoE.a2a_chunks must be 'auto' or an int >= 1, got {chunks!r}")
    if options.routing == "expert_choice":
        clash = [name for name, on in (("drop_tokens=False", not options.drop_tokens),
                                       ("dynamic_capacity=True", options.dynamic_capacity),
                                       ("balance='bias'", options.balance == "bias")) if on]
        if clash:
            errors.append(
                f"MoE.routing='expert_choice' fills every expert's capacity by construction; "
                f"it does not go with {', '.join(clash)}")
    return errors
