"""Where the program runs: devices, processes and the host.

Owns the device mesh and its axis names (`mesh`), multi-process `jax.distributed` start and CPU
device emulation (`distributed`), `jaxspeed launch` (`launch`) and the host allocator setting
(`host_allocator`).

May import: `jaxspeed.errors`. Everything else may import this.
"""
