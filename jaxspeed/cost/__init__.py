"""The cost of a plan before step 0, read from the compiled program.

Owns the HLO text parser and the collectives it finds (`hlo`), FLOP counts and the roofline
(`flops`), accelerator peaks and MFU (`peaks`), an engine's step profile (`profile`), the per-
device memory report (`memory`), the "will it fit?" verdict (`fit`) and the plan table
(`plan_table`).

May import: `config`, `ops`, `sharding`, `runtime`, `network` (the collective kinds). `fit`
checks the configs it is given a compile for (`jaxspeed.train.fit_check` compiles them through
`initialize`), so nothing here imports `train`.
"""

# The public names of the old `jaxspeed.profiler`, split into `hlo`, `flops` and `peaks`
# (`jaxspeed._moved` maps the old path here). Only those three modules, which import nothing
# of jaxspeed's but the collective kinds (`jaxspeed.network.links`): `fit`, `memory` and
# `plan_table` load `config`, `ops` and `sharding`, so they stay behind their own paths.
from jaxspeed.cost.flops import (
    compiled_flops,
    jaxpr_flops,
    memory_traffic,
    roofline_seconds,
    step_profile,
)
from jaxspeed.cost.hlo import COLLECTIVES, Collective, Dot, collective_bytes, collectives, dots
from jaxspeed.cost.peaks import PEAK_FLOPS, mfu, peak_flops

__all__ = [
    "COLLECTIVES",
    "Collective",
    "Dot",
    "PEAK_FLOPS",
    "collective_bytes",
    "collectives",
    "compiled_flops",
    "dots",
    "jaxpr_flops",
    "memory_traffic",
    "mfu",
    "peak_flops",
    "roofline_seconds",
    "step_profile",
]
