"""Load balancing of the MoE GPT: GShard's aux loss against DeepSeek-V3's bias, in one run.

    .venv/bin/python benchmarks/moe_balance.py [--steps 100] [--every 25] [--quick]

Trains `configs/gpt_moe.yaml` (expert 4 x data 2, ZeRO-3, 8 emulated CPU devices) twice from
the same initial weights and data: `model.moe.balance: aux_loss` (the config's aux loss,
coefficient 0.01) and `balance: bias` (no aux loss; `bias_update_rate`, default 0.001). Every
`--every` steps and at the end it measures, on held-out batches (deterministic routing, all of
them one group, the params gathered to one device):

- the held-out language-model loss (cross entropy alone: the aux loss is not in it);
- the load spread: the busiest expert's share of the routed choices over the mean share
  (1.0 = even), per MoE layer, and its mean over the layers.

One JSON line per measurement, a table, then the headline line: the bias run's final spread
and loss beside the aux-loss run's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

CONFIG = _common.ROOT / "configs" / "gpt_moe.yaml"
MODES = ("aux_loss", "bias")
EVAL_BATCHES = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=25, help="measure every N steps")
    parser.add_argument("--rate", type=float, default=None,
                        help="bias_update_rate (default: the config's, 0.001)")
    parser.add_argument("--quick", action="store_true", help="CI size: 6 steps, measured every 3")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every = 6, 3
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be >= 1")
    return args


def held_out(engine, state, dataset) -> tuple[float, list[float]]:
    """(mean held-out LM loss, the load spread of each MoE layer) for `state`'s params."""
    import jax
    import numpy as np

    from jaxspeed.moe.layer import METRICS
    from jaxspeed.ops.losses import lm_loss

    params = jax.device_get(state.params)
    model = engine.model.clone(stream_layers=None, gather_layers=None)
    losses, counts = [], 0.0
    for i in range(EVAL_BATCHES):
        batch = dataset.batch(i, global_batch=engine.batch_sizes.train_batch_size, split="eval")
        logits, state_out = model.apply({"params": params}, batch["inputs"], deterministic=True,
                                        mutable=[METRICS])
        losses.append(float(lm_loss(logits, batch)))
        found = [np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(state_out)
                 if "expert_counts" in jax.tree_util.keystr(path)]
        counts = counts + np.concatenate([c.reshape(-1, c.shape[-1]) for c in found])
    spreads = [float(row.max() / row.mean()) for row in counts]
    return float(np.mean(losses)), spreads


def train(mode: str, args, start=None) -> tuple[list[dict], dict]:
    """Trains one mode; returns its measurements and its initial params. `start`: another
    mode's initial params, which this run starts from (the bias, which only this mode has,
    at zero): the two runs then differ in their balancing alone. (At the same seed the GPT
    with the extra bias param starts from other router and expert weights: measured.)"""
    import jax

    import jaxspeed as js
    from jaxspeed.data import TokenDataset

    sets = [f"model.moe.balance={mode}", f"steps={args.steps}"]
    if mode == "bias" and args.rate is not None:
        sets.append(f"model.moe.bias_update_rate={args.rate}")
    config = js.load_config(CONFIG, overrides=sets)
    engine = js.initialize(config)
    dataset = TokenDataset.from_config(config.data, seed=config.seed)
    state = engine.init(jax.random.key(config.seed))
    initial = jax.device_get(state.params)
    if start is not None:
        flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(start)}
        params = jax.tree_util.tree_map_with_path(
            lambda p, v: flat.get(jax.tree_util.keystr(p), v), initial)
        state = engine.init(jax.random.key(config.seed), params=params)
    rows = []

    def measure(step: int) -> None:
        loss, spreads = held_out(engine, state, dataset)
        row = {"benchmark": "moe_balance", "balance": mode, "step": step,
               "eval_lm_loss": round(loss, 4), "load_spread": round(sum(spreads) / len(spreads), 3),
               "load_spread_per_layer": [round(s, 3) for s in spreads]}
        rows.append(row)
        _common.print_json(row)

    measure(0)
    for step in range(args.steps):
        batch = dataset.batch(step, global_batch=engine.batch_sizes.train_batch_size)
        state, _ = engine.train_step(state, batch)
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            measure(step + 1)
    return rows, initial


def main(argv=None) -> int:
    args = parse_args(argv)
    _common.use_cpu_devices()
    runs, start = {}, None
    for mode in MODES:  # the same initial weights for both
        runs[mode], initial = train(mode, args, start)
        start = start or initial
    _common.print_table(
        ["step", *[f"{m} loss" for m in MODES], *[f"{m} spread" for m in MODES]],
        [[a["step"], a["eval_lm_loss"], b["eval_lm_loss"], a["load_spread"], b["load_spread"]]
         for a, b in zip(*runs.values())])
    aux, bias = runs["aux_loss"][-1], runs["bias"][-1]
    _common.print_json(_common.result(
        "moe_balance", case=f"gpt_moe {args.steps} steps", jaxspeed=bias["load_spread"],
        baseline=aux["load_spread"], unit="busiest expert's load / mean load (1 = even)",
        ratio=_common.ratio(aux["load_spread"], bias["load_spread"]),
        bias_eval_lm_loss=bias["eval_lm_loss"], aux_loss_eval_lm_loss=aux["eval_lm_loss"],
        start_spread=runs["bias"][0]["load_spread"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
