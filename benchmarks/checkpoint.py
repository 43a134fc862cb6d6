"""Checkpoint save/restore throughput, and how long a save blocks training: async against sync.

The reference GPT at ~201M parameters (d_model 1024, 16 layers, 16 heads, d_ff 4096, vocab 256)
on 8 emulated CPU devices, mesh data=8, ZeRO stage 3, AdamW, fp32: a train state of about
2.4 GB (params, Adam m and v; 12 bytes per parameter). The state is real (`engine.init`).

Each repetition saves the same live state twice, each time with a new `Checkpointer` in a new
directory (deleted afterwards):

- **sync** (`async_save=False`): `save` returns once the checkpoint is complete on disk. Its
  duration is the stall, and state bytes / duration is the save throughput. Then
  `Checkpointer.restore(engine.abstract_state())` is timed (up to `block_until_ready`) for the
  restore throughput, and the restored state is checked against the live one.
- **async** (`async_save=True`): `save` copies the arrays off the devices and returns; Orbax
  writes in a background thread. The stall is the `save` call. A few `engine.train_step`s then
  run while the write goes on, and are timed against the same number of steps with no save in
  flight, so the background write's cost to training is shown too. The write ends when Orbax
  renames the finished step folder into place (a thread polls for it). Finally `wait()` and a
  restore check that the checkpoint holds the state as it was at `save` (the steps donate it).

The sync and async cases alternate in order between repetitions; medians are reported.
Headline: ratio = sync stall / async stall. Target: the async stall is < 10% of a sync save.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "checkpoint"
FULL = {
    "model": {"vocab_size": 256, "d_model": 1024, "n_layers": 16, "n_heads": 16, "d_ff": 4096,
              "max_seq_len": 64},
    "seq_len": 64, "repeats": 3, "steps": 2,
}
QUICK = {
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256,
              "max_seq_len": 32},
    "seq_len": 32, "repeats": 2, "steps": 1,
}
#: The issue's target: an async save blocks training for < 10% of a sync save.
STALL_TARGET = 0.10


def bench_config(case: dict):
    """Mesh data=8, micro 1, ZeRO 3, AdamW, fp32, no remat."""
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"pipe": 1, "data": -1, "expert": 1, "tensor": 1},
        "train_micro_batch_size_per_device": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "scheduler": {"type": "constant"},
        "activation_checkpointing": {"policy": "none"},
        "model": {"type": "gpt", **case["model"]},
        "data": {"source": "stdlib", "seq_len": case["seq_len"]},
    })


def filesystem_of(path: str | Path) -> tuple[str, str, str]:
    """`(mount point, filesystem type, device)` holding `path`, from /proc/mounts."""
    path = os.path.realpath(path)
    best = ("/", "unknown", "unknown")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount, fstype = line.split()[:3]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, fstype, device)
    except OSError:
        pass
    return best


def megabytes_per_s(nbytes: int, seconds: float) -> float:
    """Throughput in MB/s (10^6 bytes per second)."""
    return nbytes / 1e6 / seconds if seconds > 0 else float("nan")


class FolderWatcher:
    """Notes the moment a folder appears, from a background thread polling every `poll_s`.

    Orbax writes a step into a temporary folder and renames it to `<dir>/<step>` when the
    checkpoint is complete, so the folder's appearance is the end of an async write.
    """

    def __init__(self, path: Path, *, poll_s: float = 0.02):
        self.path = path
        self.poll_s = poll_s
        self.seen: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while self.seen is None and not self._stopped.is_set():
            if self.path.is_dir():
                self.seen = time.perf_counter()
            else:
                self._stopped.wait(self.poll_s)

    def stop(self) -> float | None:
        """Stops polling; returns the `time.perf_counter()` at which the folder appeared."""
        if self.seen is None and self.path.is_dir():
            self.seen = time.perf_counter()
        self._stopped.set()
        self._thread.join()
        return self.seen


def _overlapped(step_s: list[float], stall_s: float, write_s: float) -> int:
    """How many of the steps run after `save` returned started before the write finished."""
    start, count = stall_s, 0
    for t in step_s:
        if start < write_s:
            count += 1
        start += t
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (tests)")
    parser.add_argument("--repeats", type=int, default=None, help="saves of each kind (median)")
    parser.add_argument("--steps", type=int, default=None,
                        help="train steps timed during each async write (and without one)")
    parser.add_argument("--dir", default=None,
                        help="where the checkpoint folders go (default: the system temp dir)")
    args = parser.parse_args(argv)
    case = QUICK if args.quick else FULL
    repeats = args.repeats or case["repeats"]
    steps = args.steps or case["steps"]
    if repeats < 1 or steps < 1:
        raise SystemExit(f"--repeats and --steps must be >= 1, got {repeats} and {steps}")
    _common.use_cpu_devices()

    import jax
    import numpy as np

    from jaxspeed.checkpoint import Checkpointer
    from jaxspeed.train.engine import initialize
    from jaxspeed.models.gpt import count_params

    config = bench_config(case)
    engine = initialize(config)
    n = jax.device_count()
    abstract = engine.abstract_state()
    n_params = count_params(abstract.params)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    meta = {"config": config.to_dict()}

    rows = engine.batch_sizes.train_batch_size
    tokens = np.random.default_rng(0).integers(0, case["model"]["vocab_size"],
                                               (rows, case["seq_len"] + 1))
    batch = engine.shard_batch({"inputs": tokens[:, :-1].astype(np.int32),
                                "targets": tokens[:, 1:].astype(np.int32)})
    all_equal = jax.jit(lambda a, b: jax.tree.reduce(
        lambda x, y: x & y, jax.tree.map(lambda u, v: (u == v).all(), a, b)))
    fingerprint = jax.jit(lambda s: [x.astype("float32").sum()
                                     for x in jax.tree.leaves((s.step, s.params, s.opt_state))])

    start = time.perf_counter()
    holder = {"state": jax.block_until_ready(engine.init(jax.random.key(0)))}
    init_s = time.perf_counter() - start

    def train(count: int) -> list[float]:
        """Runs `count` train steps, each timed to completion; returns seconds per step."""
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            holder["state"], metrics = engine.train_step(holder["state"], batch)
            jax.block_until_ready((holder["state"], metrics))
            times.append(time.perf_counter() - t0)
        return times

    start = time.perf_counter()
    train(1)  # compile + first step
    compile_s = time.perf_counter() - start

    root = Path(tempfile.mkdtemp(prefix="jaxspeed_ckpt_bench_", dir=args.dir))
    mount, fstype, device = filesystem_of(root)
    print(
        f"Checkpoint save/restore: reference GPT {n_params:,} params "
        f"(d_model {case['model']['d_model']}, {case['model']['n_layers']} layers), {n} devices, "
        f"mesh data={n}, ZeRO 3, AdamW, fp32; train state {state_bytes / 1e6:,.1f} MB "
        f"(init {init_s:.1f} s, compile + first step {compile_s:.1f} s)"
    )
    print(f"checkpoints in {root} (filesystem {fstype} on {device}, mounted at {mount}); "
          f"{repeats} saves of each kind, alternating; {steps} train steps per timing")

    runs = {"sync": [], "async": []}

    def run_sync(path: Path) -> dict:
        ckpt = Checkpointer(path, keep=1, async_save=False)
        state = holder["state"]
        t0 = time.perf_counter()
        ckpt.save(state, meta=meta)
        stall = time.perf_counter() - t0
        t0 = time.perf_counter()
        restored, _ = ckpt.restore(abstract)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t0
        same = bool(all_equal(restored, state))
        del restored
        ckpt.close()
        return {"stall_s": stall, "restore_s": restore_s, "restored_equal": same}

    def run_async(path: Path) -> dict:
        ckpt = Checkpointer(path, keep=1, async_save=True)
        before = [float(x) for x in fingerprint(holder["state"])]
        step = int(jax.device_get(holder["state"].step))
        watcher = FolderWatcher(path / str(step))
        t0 = time.perf_counter()
        ckpt.save(holder["state"], meta=meta)
        stall = time.perf_counter() - t0
        step_s = train(steps)  # donates the state Orbax is still writing from
        t1 = time.perf_counter()
        ckpt.wait()
        done = time.perf_counter()
        finished = watcher.stop()
        write_s = (finished if finished is not None else done) - t0
        restored, _ = ckpt.restore(abstract)
        same = [float(x) for x in fingerprint(restored)] == before
        del restored
        ckpt.close()
        return {"stall_s": stall, "step_s": step_s, "write_s": write_s,
                "steps_overlapped": _overlapped(step_s, stall, write_s),
                "wait_s": done - t1, "restored_equal": same}

    plain_steps: list[float] = []
    try:
        for i in range(repeats):
            order = [("sync", run_sync), ("async", run_async)]
            for kind, fn in order if i % 2 == 0 else order[::-1]:
                path = root / f"{kind}_{i}"
                runs[kind].append(fn(path))
                shutil.rmtree(path, ignore_errors=True)
                gc.collect()
            plain_steps += train(steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    bad = [k for k, rs in runs.items() for r in rs if not r["restored_equal"]]
    if bad:
        raise SystemExit(f"a restored checkpoint differs from the saved state ({bad}); "
                         "the figures would be meaningless")

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    sync_ms, async_ms = med("sync", "stall_s") * 1e3, med("async", "stall_s") * 1e3
    restore_s, write_s = med("sync", "restore_s"), med("async", "write_s")
    save_mbps = megabytes_per_s(state_bytes, sync_ms / 1e3)
    restore_mbps = megabytes_per_s(state_bytes, restore_s)
    write_mbps = megabytes_per_s(state_bytes, write_s)
    step_lists = {
        "plain": plain_steps,
        "after_async_save": [t for r in runs["async"] for t in r["step_s"]],
        "overlapping_write": [t for r in runs["async"] for t in r["step_s"][:r["steps_overlapped"]]],
    }
    step_ms = {k: statistics.median(v) * 1e3 if v else None for k, v in step_lists.items()}
    r = _common.ratio(sync_ms, async_ms)
    fraction = async_ms / sync_ms

    print()
    _common.print_table(
        ["save / restore", "median", "min", "max", "MB/s (median)"],
        [
            ["sync save: stall (ms)", sync_ms, *_span(runs["sync"], "stall_s"), save_mbps],
            ["async save: stall (ms)", async_ms, *_span(runs["async"], "stall_s"), ""],
            ["async save: stall to write done (ms)", write_s * 1e3,
             *_span(runs["async"], "write_s"), write_mbps],
            ["restore (ms)", restore_s * 1e3, *_span(runs["sync"], "restore_s"), restore_mbps],
            ["ratio (sync stall / async stall)", r, "", "", ""],
        ],
    )
    print()
    labels = {"plain": "no save in flight", "after_async_save": "after an async save (all)",
              "overlapping_write": "started while the write ran"}
    _common.print_table(
        ["train step (ms)", "median", "min", "max", "steps"],
        [[labels[k], *((step_ms[k], min(v) * 1e3, max(v) * 1e3) if v else ("", "", "")), len(v)]
         for k, v in step_lists.items()],
    )
    print()
    print(
        f"async stall = {fraction:.1%} of a sync save (target < {STALL_TARGET:.0%}). The "
        f"background write took {write_s:.2f} s (median, from the save call to the step folder "
        f"appearing); {sum(r['steps_overlapped'] for r in runs['async'])} of "
        f"{len(step_lists['after_async_save'])} timed steps started while it ran. Every "
        "restored checkpoint matched the state it saved. Restores read files just written, "
        "so they may come from the page cache."
    )
    _common.print_json(_common.result(
        NAME,
        case=(f"gpt d_model={case['model']['d_model']} layers={case['model']['n_layers']} "
              f"params={n_params} devices={n} zero=3 fp32 adamw"),
        jaxspeed=async_ms, baseline=sync_ms, unit="ms stall", ratio=r,
        save_MBps=round(save_mbps, 3), restore_MBps=round(restore_mbps, 3),
        async_write_MBps=round(write_mbps, 3),
        stall_fraction=round(fraction, 4), target_met=fraction < STALL_TARGET,
        step_ms={k: None if v is None else round(v, 1) for k, v in step_ms.items()},
        state_bytes=state_bytes, n_params=n_params, repeats=repeats,
        filesystem={"path": str(root.parent), "type": fstype, "device": device, "mount": mount},
        runs={k: [_rounded(x) for x in rs] for k, rs in runs.items()},
    ))
    return 0


def _span(runs: list[dict], key: str) -> list[float]:
    values = [r[key] * 1e3 for r in runs]
    return [min(values), max(values)]


def _rounded(run: dict) -> dict:
    out = {}
    for k, v in run.items():
        if isinstance(v, float):
            out[k] = round(v, 4)
        elif isinstance(v, list):
            out[k] = [round(x, 4) for x in v]
        else:
            out[k] = v
    return out


if __name__ == "__main__":
    raise SystemExit(main())
