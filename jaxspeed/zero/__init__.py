"""ZeRO-3 with the collectives written in the step: DeepSpeed's gathers and reduce-scatters,
ZeRO++'s quantized weights (qwZ), quantized gradients (qgZ) and secondary copy (hpZ).

Owns the step (`step`: `ZeroStep`, run inside a `shard_map` manual over the ZeRO axes), the
gathers and reduce-scatters with their transposes (`collectives`), the wire formats and
two-level exchanges they run on (`comm`) and how a leaf's blocks are laid out on the ZeRO axes
(`layout`). Which axes a leaf's ZeRO partition uses is the planner's rule
(`jaxspeed.sharding.zero`), which this package reads.

May import: `sharding`, `network`, `ops`, `runtime`, `errors`.
"""
