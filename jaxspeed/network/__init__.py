"""What collectives cost on a cluster's links.

Owns the collective kinds and one collective's ring / pairwise cost on one link (`links`),
where a collective's members sit on a mesh (`placement`), gloo's flat algorithms (`gloo`) and
a collective along mesh axes on hosts, hierarchical as NCCL runs it or flat as gloo does
(`collectives`). The planner (`jaxspeed.autoplan`) prices a compiled step with it, and MoE's
`parallelism: auto` its strategies.

May import: `jaxspeed.runtime`, `jaxspeed.gpu`, `jaxspeed.errors`, `jaxspeed.tree_paths`.
Nothing of jaxspeed's above it: `jaxspeed.cost.hlo` takes the collective kinds from here.
"""
