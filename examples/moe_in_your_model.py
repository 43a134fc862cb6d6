"""Put `js.moe.MoE` into your own Flax Linen model and train it with expert parallelism.

The model below is yours, not jaxspeed's reference GPT: a byte embedding, one causal attention
block, and a mixture-of-experts feed-forward (`js.moe.MoE`) in place of the usual MLP. jaxspeed
trains it on a mesh of expert=4 x data=2 (8 emulated CPU devices) with ZeRO stage 3:

* each device holds E / 4 of the experts (the `expert` logical axis of the MoE's weights is
  mapped to the `expert` mesh axis), and ZeRO-3 splits them further over `data`;
* the other weights are ZeRO-3 sharded over all 8 devices (data x expert);
* every device routes its own tokens, which travel to the devices owning their experts
  (all_to_all) and come back.

How the load-balancing loss gets into training, with no code on your side:

1. `MoE.__call__` records its aux loss with `self.sow("aux_loss", "moe", value)`: the
   coefficient-scaled GShard balance loss (`aux_loss_coef`) plus the router z-loss.
2. The engine applies a Linen model with `mutable=["aux_loss"]`, sums every leaf of that
   collection (all MoE layers, wherever they sit in your module tree), adds the sum to the
   loss of your outputs, and reports it as `metrics["aux_loss"]`. `metrics["loss"]` is the
   total the gradients are taken of (cross entropy + aux loss).
3. The engine also passes `deterministic=not train` (because `__call__` takes it) and a
   "gating" rng (random token selection, noisy gates), so training and evaluation differ
   the way DeepSpeed-MoE's do (`capacity_factor` vs `eval_capacity_factor`).

    python examples/moe_in_your_model.py                       # 8 emulated CPU devices
    python examples/moe_in_your_model.py --steps 100 --experts 16 --k 1
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxspeed as js
from jaxspeed.data import TokenDataset

INIT = nn.initializers.normal(stddev=0.02)

#: The whole jaxspeed config, as a dict (a YAML path works the same).
CONFIG = {
    "mesh": {"pipe": 1, "data": 2, "expert": 4, "tensor": 1},  # 8 devices, all data-parallel
    "train_micro_batch_size_per_device": 2,  # global batch 16 sequences
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosine",
                  "params": {"warmup_num_steps": 5, "total_num_steps": 40}},
    "data": {"source": "stdlib", "seq_len": 64, "max_bytes": 2_000_000},
    "steps": 40,
    "seed": 0,
}


def weight(module, name, shape, names):
    """A parameter whose dimensions carry the logical axis `names` (one per dimension)."""
    return module.param(name, nn.with_logical_partitioning(INIT, names), shape)


def rms_norm(x):
    """[..., embed] → the same, scaled to unit root-mean-square over `embed`."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


class MoEByteLM(nn.Module):
    """Bytes → next-byte logits: embedding, causal attention, MoE feed-forward, head.

    `tokens: int [batch, length]` → float `[batch, length, vocab]`.
    """

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    max_len: int = 64
    num_experts: int = 8
    expert_hidden: int = 128
    k: int = 2

    @nn.compact
    def __call__(self, tokens, deterministic: bool = False):
        length, e, h, d = tokens.shape[1], self.embed, self.heads, self.embed // self.heads
        x = weight(self, "embedding", (self.vocab, e), ("vocab", "embed"))[tokens]
        x = x + weight(self, "positions", (self.max_len, e), (None, "embed"))[:length]
        # Causal self-attention.
        normed = rms_norm(x)
        q, k, v = (
            jnp.einsum("ble,ehd->blhd", normed,
                       weight(self, n, (e, h, d), ("embed", "heads", "kv")))
            for n in ("query", "key", "value")
        )
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jnp.einsum("blhd,hde->ble", attn, weight(self, "out", (h, d, e),
                                                         ("heads", "kv", "embed")))
        # The feed-forward is a mixture of experts. Its expert weights are created with the
        # logical axes ("expert", "embed", "mlp") / ("expert", "mlp", "embed"), which is all
        # jaxspeed needs to place them on the `expert` mesh axis. It sows its aux loss into
        # the "aux_loss" collection (see the module docstring): nothing to return or add here.
        x = x + js.moe.MoE(
            num_experts=self.num_experts,
            d_ff=self.expert_hidden,
            k=self.k,
            # Training capacity: ceil(k * 1.25 * Tg / E) slots per expert in each group of Tg
            # tokens (one group per data-parallel device); overflowing choices are dropped.
            capacity_factor=1.25,
            eval_capacity_factor=2.0,    # with deterministic=True
            aux_loss_coef=0.01,          # GShard balance loss weight
            activation="gelu",
            name="moe",
        )(rms_norm(x), deterministic=deterministic)
        return rms_norm(x) @ weight(self, "head", (e, self.vocab), ("embed", "vocab"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--experts", type=int, default=8, help="number of experts (divisible by 4)")
    parser.add_argument("--k", type=int, default=2, help="experts per token")
    parser.add_argument(
        "--eval", action=argparse.BooleanOptionalAction, default=True,
        help="end with one held-out batch in eval mode (deterministic=True)",
    )
    parser.add_argument(
        "--cpu-devices", type=int, default=8,
        help="emulate N CPU devices (0 = use the machine's real accelerators)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set zero_optimization.stage=0 (repeatable)",
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main():
    args = parse_args()
    if args.cpu_devices:  # sets XLA_FLAGS before any JAX computation fixes the device count
        js.distributed.set_cpu_devices(args.cpu_devices)
    config = js.load_config(CONFIG, overrides=[f"steps={args.steps}", *args.overrides])
    dataset = TokenDataset.from_config(config.data, seed=config.seed)

    model = MoEByteLM(vocab=dataset.vocab_size, max_len=config.data.seq_len,
                      num_experts=args.experts, k=args.k)
    engine = js.initialize(config, model=model)  # params are created already sharded
    state = engine.init(jax.random.key(config.seed))
    for step in range(config.steps):
        batch = dataset.batch(step, global_batch=engine.batch_sizes.train_batch_size)
        state, metrics = engine.train_step(state, batch)
        # loss = next-byte cross entropy + aux_loss; aux_loss = what the MoE layer sowed.
        loss, aux = float(metrics["loss"]), float(metrics["aux_loss"])
        print(f"step {step + 1:4d}  loss {loss:.4f}  aux_loss {aux:.5f}", flush=True)
    if args.eval:  # deterministic=True: eval_capacity_factor, no random token selection
        batch = dataset.batch(0, global_batch=engine.batch_sizes.train_batch_size, split="eval")
        print(f"eval loss {float(engine.eval_step(state, batch)['loss']):.4f}")
    print(engine.plan.explain())


if __name__ == "__main__":
    main()
