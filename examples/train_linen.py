"""Train your own Flax Linen model with jaxspeed, from a config file.

The model names the dimensions of its parameters (`vocab`, `embed`, `heads`, `kv`, `mlp`) with
`nn.with_logical_partitioning`; jaxspeed maps those names to the mesh (`heads`, `mlp`, `vocab`
→ `tensor`) and ZeRO spreads the state over `data`. The model never mentions a mesh axis.

    python examples/train_linen.py                                  # 8 emulated CPU devices
    python examples/train_linen.py --steps 200 --set zero_optimization.stage=1
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxspeed as js
from jaxspeed.data import TokenDataset

INIT = nn.initializers.normal(stddev=0.02)


def weight(module, name, shape, names):
    """A parameter whose dimensions carry the logical axis `names` (one per dimension)."""
    return module.param(name, nn.with_logical_partitioning(INIT, names), shape)


def rms_norm(x):
    """[..., embed] → the same, scaled to unit root-mean-square over `embed`."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


class TinyLM(nn.Module):
    """One causal transformer block over bytes: tokens [batch, length] → logits [.., vocab]."""

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    mlp: int = 256
    max_len: int = 64

    @nn.compact
    def __call__(self, tokens):
        length, e, h, d = tokens.shape[1], self.embed, self.heads, self.embed // self.heads
        x = weight(self, "embedding", (self.vocab, e), ("vocab", "embed"))[tokens]
        x = x + weight(self, "positions", (self.max_len, e), (None, "embed"))[:length]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))  # activation layout hint
        # Causal self-attention; the heads are split over the `tensor` mesh axis.
        normed = rms_norm(x)
        qkv_names = ("embed", "heads", "kv")
        q, k, v = (
            jnp.einsum("ble,ehd->blhd", normed, weight(self, n, (e, h, d), qkv_names))
            for n in ("query", "key", "value")
        )
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [batch, length, heads, kv]
        out = weight(self, "out", (h, d, e), ("heads", "kv", "embed"))
        x = x + jnp.einsum("blhd,hde->ble", attn, out)
        # MLP; its hidden units are split over `tensor`.
        hidden = nn.gelu(rms_norm(x) @ weight(self, "mlp_in", (e, self.mlp), ("embed", "mlp")))
        x = x + hidden @ weight(self, "mlp_out", (self.mlp, e), ("mlp", "embed"))
        return rms_norm(x) @ weight(self, "head", (e, self.vocab), ("embed", "vocab"))


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

    model = TinyLM(vocab=dataset.vocab_size, max_len=cfg.data.seq_len)
    engine = js.initialize(config=cfg, model=model)  # Linen: params are created sharded
    state = engine.init(jax.random.key(cfg.seed))
    for step in range(args.steps or cfg.steps):
        batch = dataset.batch(step, global_batch=engine.batch_sizes.train_batch_size)
        state, metrics = engine.train_step(state, batch)  # default loss: next-token cross entropy
        loss, lr = float(metrics["loss"]), float(metrics["lr"])
        print(f"step {step + 1:4d}  loss {loss:.4f}  lr {lr:.2e}", flush=True)
    print(engine.plan.explain())


if __name__ == "__main__":
    main()
