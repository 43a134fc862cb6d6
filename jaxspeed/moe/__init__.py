"""Mixture of experts: top-k gating, dispatch/combine (Pallas or XLA), expert FFNs, dropless,
the `MoE` Flax layer and expert parallelism."""

from jaxspeed.moe.dispatch import combine, dispatch
from jaxspeed.moe.experts import ExpertParams, dropless_ffn, expert_ffn, init_expert_params
from jaxspeed.moe.gating import Routing, compute_capacity, top_k_gating
from jaxspeed.moe.layer import MoE
from jaxspeed.moe.parallel import moe_ffn

__all__ = [
    "ExpertParams",
    "MoE",
    "Routing",
    "combine",
    "compute_capacity",
    "dispatch",
    "dropless_ffn",
    "expert_ffn",
    "init_expert_params",
    "moe_ffn",
    "top_k_gating",
]
