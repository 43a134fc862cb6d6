"""The sharding planner: logical axis rules, ZeRO stages, per-device bytes, `explain()`."""

from jaxspeed.sharding.leaves import LeafPlan
from jaxspeed.sharding.planner import Plan, plan_sharding
from jaxspeed.sharding.rules import DEFAULT_RULES, logical_to_spec
from jaxspeed.sharding.zero import zero_spec

__all__ = ["DEFAULT_RULES", "LeafPlan", "Plan", "logical_to_spec", "plan_sharding", "zero_spec"]
