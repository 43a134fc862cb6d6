"""Training: the engine, its jitted step and the loop that drives it.

Owns `initialize` and `Engine` (`engine`), what `initialize` assembles from a config: checks,
the reference model, the objective (`assembly`), the train/eval step with accumulation,
clipping and loss scaling (`step`), the 1-bit Adam step (`onebit_step`), how a user's model
plugs in (`adapters`), the run loop with logging, evaluation and checkpoints (`loop`; its
`train` is `jaxspeed.train.train` here and `jaxspeed.train_model` at the top), its output
folder and the lock that keeps a second run out of it (`run_dir`), the metrics log
(`metrics_log`, `TrainRecord`), whether an engine's plan fits the device (`fit_check`) and a
trained run rebuilt from its checkpoint on any devices (`trained`). `TrainState` (`step`) is
jaxspeed's own pytree of arrays, not `flax.training.train_state.TrainState`: it holds no
`apply_fn` or `tx` (the engine does).

May import every package below it: `config`, `runtime`, `ops`, `attention`, `moe`,
`pipeline`, `optim`, `sharding`, `data`, `models`, `cost`, `checkpoint`.
"""

from jaxspeed.train.engine import Engine, initialize
from jaxspeed.train.loop import train
from jaxspeed.train.metrics_log import TrainRecord
from jaxspeed.train.step import TrainState

__all__ = ["Engine", "TrainRecord", "TrainState", "initialize", "train"]
