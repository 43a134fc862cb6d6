"""The attention implementations a config may name."""

#: `model.sparse_attention.impl`: how block-sparse attention runs
#: (`jaxspeed.attention.block_sparse.block_sparse_attention`).
SPARSE_IMPLS = ("auto", "pallas", "xla", "blocked")
#: `model.sequence_parallel.impl`: how attention runs over a sequence split
#: (`jaxspeed.attention.sequence_parallel`).
SEQUENCE_IMPLS = ("ulysses", "ring")
