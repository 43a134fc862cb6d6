"""`Engine.abstract_batch` is the batch given to `initialize` (rows scaled to the global batch),
so a custom model's step compiles for its own shapes; token models keep `[rows, seq_len]`."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import jaxspeed as js

CONFIG = ["zero_optimization.stage=2", "train_micro_batch_size_per_device=1"]


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):  # [batch, 16] -> [batch, 4]
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return x @ self.param("w", init, (16, 4))


def _mse(outputs, batch):
    return jnp.mean(jnp.square(outputs - batch["targets"]))


def test_abstract_batch_follows_the_sample_batch():
    cfg = js.load_config("configs/gpt_zero3.yaml", overrides=CONFIG)
    sample = {"inputs": np.zeros((3, 16), np.float32), "targets": np.zeros((3, 4), np.float32),
              "weights": np.zeros((3,), np.float32)}
    engine = js.initialize(cfg, model=Dense(), loss_fn=_mse, sample_batch=sample)
    rows = engine.batch_sizes.train_batch_size
    batch = engine.abstract_batch()
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "inputs": ((rows, 16), jnp.float32), "targets": ((rows, 4), jnp.float32),
        "weights": ((rows,), jnp.float32)}
    assert batch["inputs"].sharding == engine.batch_sharding(2)
    assert batch["weights"].sharding == engine.batch_sharding(1)
    assert engine.memory_report()["per_device_bytes"]["params"] == 16 * 4 * 4


def test_default_loss_gets_targets_like_the_inputs():
    cfg = js.load_config("configs/gpt_tiny.yaml")
    sample = {"inputs": np.zeros((1, 32), np.int32)}
    batch = js.initialize(cfg, sample_batch=sample).abstract_batch()
    assert batch["targets"].shape == batch["inputs"].shape == (8, 32)
    assert js.initialize(cfg).abstract_batch()["inputs"].shape == (8, cfg.data.seq_len)
