"""An MoE layer's static routing and exchange options (`GatingOptions`), shared by the layer
(`jaxspeed.moe.parallel.moe_ffn`) and the exchange it runs (`jaxspeed.moe.exchange`)."""

from __future__ import annotations

import dataclasses

from jaxspeed.moe.strategies import Links


@dataclasses.dataclass(frozen=True)
class GatingOptions:
    """Static routing options, as in `top_k_gating` (see there)."""

    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    gate_noise: float = 0.0
    bpr: bool = False
    normalize_gate: bool = True
    z_loss_coef: float = 0.0
    activation: str = "gelu"
    impl: str = "auto"
    eval_mode: bool = False
    dynamic_capacity: bool = False
    routing: str = "token_choice"  #: or "expert_choice" (`jaxspeed.moe.expert_choice`)
    a2a_chunks: int | str = 1  #: or "auto" (`jaxspeed.moe.all_to_all.a2a_chunk_count`)
    all_to_all: str = "flat"  #: or "hierarchical" (`jaxspeed.moe.all_to_all`)
    a2a_hosts: int | None = None  #: hosts the expert axis spans; None: its processes
    parallelism: str = "expert"  #: `jaxspeed.moe.strategies.PARALLELISMS`
    cluster: Links | None = None  #: the links `parallelism="auto"` prices (`strategies.links_of`)
    fp8: str | None = None  #: the experts' FP8 recipe (`jaxspeed.ops.fp8`), or None

    @property
    def needs_rng(self) -> bool:
        """Whether routing is random (and so needs a key)."""
        return not self.eval_mode and bool(self.random_features)

    @property
    def random_features(self) -> tuple[str, ...]:
        """Names of the options that make routing random outside eval mode."""
        names = []
        if self.noisy_gate_policy not in (None, "None"):
            names.append(f"noisy_gate_policy={self.noisy_gate_policy!r}")
        if self.use_rts and self.drop_tokens and self.routing == "token_choice":
            # without drops the token order changes nothing; experts choosing have no order
            names.append("use_rts=True")
        if self.gate_noise > 0:
            names.append(f"gate_noise={self.gate_noise}")
        return tuple(names)
