"""Training: the engine, its jitted step and the loop that drives it.

Owns `initialize` and `Engine` (`engine`), what `initialize` assembles from a config: checks,
the reference model, the objective (`assembly`), the train/eval step with accumulation, clipping and
loss scaling (`step`), the 1-bit Adam step (`onebit_step`), how a user's model plugs in
(`adapters`), the run loop with logging, evaluation and checkpoints (`loop`) and the metrics
log (`metrics_log`).

May import every package below it: `config`, `runtime`, `ops`, `attention`, `moe`,
`pipeline`, `optim`, `sharding`, `data`, `models`, `cost`, `checkpoint.state`.
"""

from jaxspeed.train.engine import Engine, initialize
from jaxspeed.train.step import TrainState

__all__ = ["Engine", "TrainState", "initialize"]
