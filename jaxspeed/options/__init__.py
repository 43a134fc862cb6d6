"""The layers' options as plain data: the values each option takes, and the MoE layer's option
fields with their checks. Nothing here imports JAX, so `jaxspeed.config` types `model.moe`,
`model.sparse_attention`, `model.sequence_parallel` and `fp8` from these without loading it.

Owns the MoE layer's options (`moe`: `MoeOptions`, `option_errors`), the attention
implementations' names (`attention`) and FP8's recipes and projections (`fp8`).

May import: `jaxspeed.errors`. The layers (`moe`, `attention`, `ops`) and `config` import it.
"""
