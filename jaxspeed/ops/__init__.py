"""Numerics and memory policy shared by the models and the train step.

Owns matmul precision (`matmul`), mixed-precision policies and loss scaling (`precision`),
memory kinds and host/device transfers (`offload`), rematerialisation policies (`remat`) and
the losses with the auxiliary-loss collection (`losses`).

May import: `jaxspeed.errors`, `pallas_kernels` (the backend check). No mesh, no config.
"""
