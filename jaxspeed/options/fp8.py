"""FP8's recipes, the projections it applies to, and the default amax history
(`jaxspeed.ops.fp8`)."""

#: `fp8.recipe`: current scaling per tensor or per row, or Transformer Engine's delayed one.
RECIPES = ("tensorwise", "rowwise", "delayed")
#: The projections FP8 applies to, by name: attention's q/k/v/out, the MLP's, the experts'.
#: The embedding, the LM head, the norms and attention itself stay in the compute dtype.
PROJECTIONS = ("query", "key", "value", "out", "wi", "wi_gate", "wi_up", "wo", "experts")
#: Transformer Engine's and Flax's default amax history.
HISTORY = 1024
