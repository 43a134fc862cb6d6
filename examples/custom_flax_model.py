import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import jaxspeed as js

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):                                  # x: [batch, 16]
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return x @ self.param("w", init, (16, 64))          # [batch, 64]

def my_loss(outputs, batch):                                # (model outputs, the whole batch)
    return jnp.mean(jnp.square(outputs - batch["targets"]))

def make_batch(rows, seed=0):                               # "inputs" go to the model
    rng = np.random.default_rng(seed)
    return {"inputs": rng.normal(size=(rows, 16)).astype(np.float32),
            "targets": rng.normal(size=(rows, 64)).astype(np.float32)}

cfg = js.load_config("configs/gpt_zero3.yaml", overrides=["zero_optimization.stage=2"])
engine = js.initialize(config=cfg, model=MLP(), loss_fn=my_loss, sample_batch=make_batch(1))
batch = make_batch(engine.batch_sizes.train_batch_size)    # global: micro x accumulation x data
state = engine.init(jax.random.key(0))
state, metrics = engine.train_step(state, batch)           # loss, grad_norm, lr
print("loss", float(metrics["loss"]))
print(engine.plan.explain())                               # where every parameter lives
print(engine.memory_report()["per_device_bytes"])          # compiled for the sample's shapes
