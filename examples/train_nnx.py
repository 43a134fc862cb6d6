"""Train your own Flax NNX model with jaxspeed, from a config file.

The model names the dimensions of its parameters (`vocab`, `embed`, `heads`, `kv`, `mlp`) with
`nnx.with_partitioning`; jaxspeed trains its `nnx.Param`s, maps those names to the mesh
(`heads`, `mlp`, `vocab` → `tensor`) and ZeRO spreads the state over `data`.

    python examples/train_nnx.py                                    # 8 emulated CPU devices
    python examples/train_nnx.py --steps 200 --set zero_optimization.stage=1
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

import jaxspeed as js
from jaxspeed.data import TokenDataset

INIT = nnx.initializers.normal(stddev=0.02)


def named(names):
    """An initializer whose parameter dimensions carry the logical axis `names`."""
    return nnx.with_partitioning(INIT, names)


def rms_norm(x):
    """[..., embed] → the same, scaled to unit root-mean-square over `embed`."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


class TinyLM(nnx.Module):
    """One causal transformer block over bytes: tokens [batch, length] → logits [.., vocab]."""

    def __init__(self, *, vocab=256, embed=64, heads=4, mlp=256, max_len=64, rngs: nnx.Rngs):
        h, d = heads, embed // heads
        self.embedding = nnx.Embed(vocab, embed, embedding_init=named(("vocab", "embed")),
                                   rngs=rngs)
        self.positions = nnx.Param(named((None, "embed"))(rngs.params(), (max_len, embed)))
        # Causal self-attention; the heads are split over the `tensor` mesh axis.
        self.query, self.key, self.value = (
            nnx.Einsum("ble,ehd->blhd", (embed, h, d), kernel_init=named(("embed", "heads", "kv")),
                       rngs=rngs)
            for _ in range(3)
        )
        self.out = nnx.Einsum("blhd,hde->ble", (h, d, embed),
                              kernel_init=named(("heads", "kv", "embed")), rngs=rngs)
        # MLP; its hidden units are split over `tensor`.
        self.mlp_in = nnx.Linear(embed, mlp, use_bias=False, kernel_init=named(("embed", "mlp")),
                                 rngs=rngs)
        self.mlp_out = nnx.Linear(mlp, embed, use_bias=False, kernel_init=named(("mlp", "embed")),
                                  rngs=rngs)
        self.head = nnx.Linear(embed, vocab, use_bias=False, kernel_init=named(("embed", "vocab")),
                               rngs=rngs)

    def __call__(self, tokens):
        x = self.embedding(tokens) + self.positions[: tokens.shape[1]]  # [batch, length, embed]
        normed = rms_norm(x)
        q, k, v = self.query(normed), self.key(normed), self.value(normed)
        x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True))
        x = x + self.mlp_out(nnx.gelu(self.mlp_in(rms_norm(x))))
        return self.head(rms_norm(x))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/example.yaml", help="YAML or JSON config")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's steps")
    parser.add_argument(
        "--cpu-devices", type=int, default=8,
        help="emulate N CPU devices (0 = use the machine's real accelerators)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set zero_optimization.stage=2 (repeatable)",
    )
    return parser.parse_args()


def main():
    args = parse_args()
    if args.cpu_devices:  # before any JAX computation: the device count is fixed at start-up
        jax.config.update("jax_platforms", "cpu")
        js.distributed.set_cpu_devices(args.cpu_devices)
    cfg = js.load_config(args.config, overrides=args.overrides)
    dataset = TokenDataset.from_config(cfg.data, seed=cfg.seed)

    with nnx.use_eager_sharding(False):  # jaxspeed places the params; Flax must not shard them
        model = TinyLM(vocab=dataset.vocab_size, max_len=cfg.data.seq_len, rngs=nnx.Rngs(cfg.seed))
    engine = js.initialize(config=cfg, model=model)
    state = engine.init(jax.random.key(cfg.seed))
    for step in range(args.steps or cfg.steps):
        batch = dataset.batch(step, global_batch=engine.batch_sizes.train_batch_size)
        state, metrics = engine.train_step(state, batch)  # default loss: next-token cross entropy
        loss, lr = float(metrics["loss"]), float(metrics["lr"])
        print(f"step {step + 1:4d}  loss {loss:.4f}  lr {lr:.2e}", flush=True)
    print(engine.plan.explain())


if __name__ == "__main__":
    main()
