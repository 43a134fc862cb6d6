"""Mixture of experts: top-k gating, dispatch/combine (Pallas or XLA), expert FFNs, dropless."""

from jaxspeed.moe.dispatch import combine, dispatch
from jaxspeed.moe.experts import ExpertParams, dropless_ffn, expert_ffn, init_expert_params
from jaxspeed.moe.gating import Routing, compute_capacity, top_k_gating

__all__ = [
    "ExpertParams",
    "Routing",
    "combine",
    "compute_capacity",
    "dispatch",
    "dropless_ffn",
    "expert_ffn",
    "init_expert_params",
    "top_k_gating",
]
