"""The cost of a plan before step 0, read from the compiled program.

Owns the HLO text parser and the collectives it finds (`hlo`), FLOP counts and the roofline
(`flops`), accelerator peaks and MFU (`peaks`), the per-device memory report (`memory`), the
"will it fit?" verdict (`fit`) and the plan table (`report`).

May import: `config`, `ops`, `sharding`. `fit` compiles candidate configs through
`jaxspeed.train.initialize`, imported inside the function, so `train` may import `cost`.
"""
