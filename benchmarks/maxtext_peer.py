"""MaxText run beside jaxspeed: its install, and one training run of a jaxspeed config's model.

    python benchmarks/maxtext_peer.py setup [--venv DIR]   # once: MaxText 0.2.5 in a venv (~2.5 GB)
    make maxtext                                          # the same, into the default venv
    python benchmarks/maxtext_peer.py run CONFIG [--set KEY=VALUE ...]

`benchmarks/throughput.py --maxtext PYTHON` uses this module to time MaxText on the same model,
mesh, precision and remat as each jaxspeed configuration, in the same run. MaxText lives in a
venv of its own (default `~/.cache/jaxspeed-peers/maxtext`, or `$MAXTEXT_VENV`) because it pins
its own dependencies; nothing of it enters the project's `.venv`.

A run trains MaxText's decoder (RMSNorm, SwiGLU, rotary, untied embeddings: the llama shape of
`configs/bench_tiny_llama.yaml`) on synthetic tokens with `per_device_batch_size` sequences per
device on 8 emulated CPU devices, and reads the seconds of every step from MaxText's log
("completed step: N, seconds: S"). It runs under the host allocator jaxspeed runs under in this
process (`jaxspeed.runtime.host_allocator.child_env`: glibc tunables with the settings of
`keep_freed_memory`), so a ratio compares the trainers, not two allocators; `same_allocator=False`
runs it under glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

VERSION = "0.2.5"
DEFAULT_VENV = Path(os.environ.get("MAXTEXT_VENV", Path.home() / ".cache/jaxspeed-peers/maxtext"))
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")
#: jaxspeed remat policy -> MaxText `remat_policy` (the two with the same meaning).
REMAT = {"full": "full", "none": "none"}


def setup(venv: Path = DEFAULT_VENV) -> Path:
    """Installs MaxText `VERSION` and its CPU requirements into `venv`; returns its Python."""
    python = venv / "bin" / "python"
    if not python.exists():
        base = subprocess.run([str(_common.ROOT / "tools" / "find_python.sh")],
                              capture_output=True, text=True)
        if base.returncode:
            raise SystemExit(base.stderr.strip())
        subprocess.run([base.stdout.strip(), "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, f"maxtext=={VERSION}"], check=True)
    # MaxText's own list for running without Google Cloud (`DECOUPLE_GCLOUD`), shipped with it.
    requirements = subprocess.run(
        [str(python), "-c", "import maxtext, pathlib; root = pathlib.Path(maxtext.__file__)"
         ".parents[1]; print(next(root.rglob('decoupled-requirements.txt')))"],
        capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([*pip, "-r", requirements], check=True)
    return python


def options(config) -> dict[str, str]:
    """MaxText's options for the model, mesh, precision, remat and optimizer of `config`.

    ZeRO-3 is MaxText's FSDP axis; ZeRO-1 and 2 are its data axis with the optimizer state
    sharded over it (`shard_optimizer_over_data`; MaxText has no separate ZeRO-2); ZeRO-0 is its
    plain data axis. Weights and optimizer state stay fp32 in both; bf16 is the compute dtype.
    """
    from jaxspeed.config import resolve_batch
    from jaxspeed.runtime.mesh import data_parallel_size, make_mesh

    m, mesh, stage = config.model, config.mesh, config.zero_optimization.stage
    unsupported = {
        "pipe": mesh.pipe != 1, "expert": mesh.expert != 1, "moe": m.moe is not None,
        "remat": config.activation_checkpointing.policy not in REMAT,
        "optimizer": config.optimizer.type not in ("Adam", "AdamW"),
        "model": (m.norm, m.mlp, m.positions, m.tie_embeddings)
        != ("rmsnorm", "swiglu", "rotary", False),
    }
    if any(unsupported.values()):
        raise ValueError(
            f"no MaxText equivalent for {[k for k, v in unsupported.items() if v]} of this "
            "config; the peer covers llama-shaped models on data x tensor meshes with remat "
            f"{sorted(REMAT)}")
    device_mesh = make_mesh(mesh)
    data = data_parallel_size(device_mesh)
    batch = resolve_batch(config, data)
    # MaxText's per-device batch counts every device, tensor-parallel ones too: the same global
    # batch of sequences per micro step is micro x data / devices of them.
    per_device = batch.micro_batch_per_device * data / device_mesh.devices.size
    params = config.optimizer.params
    return {
        "per_device_batch_size": f"{per_device:g}",
        "gradient_accumulation_steps": str(batch.accumulation_steps),
        "max_target_length": str(config.data.seq_len),
        "vocab_size": str(m.vocab_size), "base_emb_dim": str(m.d_model),
        "base_num_query_heads": str(m.n_heads), "base_num_kv_heads": str(m.n_heads),
        "head_dim": str(m.d_model // m.n_heads), "base_mlp_dim": str(m.d_ff),
        "base_num_decoder_layers": str(m.n_layers),
        "ici_fsdp_parallelism": str(data if stage == 3 else 1),
        "ici_data_parallelism": str(1 if stage == 3 else data),
        "ici_tensor_parallelism": str(mesh.tensor),
        "shard_optimizer_over_data": str(stage in (1, 2)).lower(),
        "dtype": "bfloat16" if config.bf16.enabled else "float32", "weight_dtype": "float32",
        "remat_policy": REMAT[config.activation_checkpointing.policy],
        "learning_rate": str(params.lr),
        "adam_b1": str(params.betas[0]),
        "adam_b2": str(params.betas[1]),
        "adam_eps": str(params.eps),
        "adam_weight_decay": str(params.weight_decay),
        "gradient_clipping_threshold": str(config.gradient_clipping or 0.0),
    }


def base_config(python: str | Path) -> str:
    """The path of MaxText's `base.yml` in the venv of `python`.

    Raises:
      RuntimeError: `python` cannot be run, or cannot import maxtext.
    """
    script = ("import maxtext, os; "
              "print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))")
    try:
        base = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    except OSError as err:
        raise RuntimeError(f"cannot run {python} ({err.strerror}); pass the Python of the venv "
                           "`make maxtext` made") from err
    if base.returncode:
        raise RuntimeError(f"{python} cannot import maxtext (run `make maxtext`): "
                           f"{base.stderr.strip().splitlines()[-1:]}")
    return base.stdout.strip()


def allocator_env(*, same_allocator: bool = True) -> dict[str, str]:
    """The environment MaxText starts in: this process's host allocator as glibc tunables
    (`same_allocator`), or the environment as it is (glibc's defaults)."""
    from jaxspeed.runtime.host_allocator import child_env

    return child_env() if same_allocator else dict(os.environ)


def allocator(*, same_allocator: bool = True) -> str:
    """What `run` gives MaxText as its allocator, in words (for the benchmark's JSON)."""
    tunables = allocator_env(same_allocator=same_allocator).get("GLIBC_TUNABLES")
    return f"GLIBC_TUNABLES={tunables}" if tunables else "glibc defaults"


def run(python: str | Path, opts: dict[str, str], *, steps: int, devices: int = 8,
        timeout: float = 1800.0, same_allocator: bool = True) -> dict[int, float]:
    """Trains MaxText for `steps` steps with `opts`; returns {0-based step: seconds}.

    `same_allocator`: under this process's host allocator (`allocator_env`), else glibc's
    defaults.

    Raises:
      RuntimeError: MaxText failed or logged no step (with the end of its log).
    """
    base = base_config(python)
    env = {**allocator_env(same_allocator=same_allocator), "JAX_PLATFORMS": "cpu",
           "DECOUPLE_GCLOUD": "TRUE",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    with tempfile.TemporaryDirectory(prefix="jaxspeed-maxtext-") as out:
        fixed = {"run_name": "peer", "base_output_directory": out,
                 "dataset_type": "synthetic", "steps": str(steps), "hardware": "cpu",
                 "enable_checkpointing": "false", "skip_jax_distributed_system": "true",
                 "jax_cache_dir": ""}
        argv = [f"{k}={v}" for k, v in {**fixed, **opts}.items()]
        proc = subprocess.run(
            [str(python), "-m", "maxtext.trainers.pre_train.train", base, *argv],
            env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    seconds = step_seconds(log)
    if proc.returncode or len(seconds) < steps:
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise RuntimeError(f"MaxText exited {proc.returncode} after {len(seconds)} of {steps} "
                           f"logged steps; the end of its log:\n{tail}")
    return seconds


def step_seconds(log: str) -> dict[int, float]:
    """{0-based step: seconds} from MaxText's "completed step: N, seconds: S" lines."""
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(log)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help=f"install MaxText {VERSION} into a venv")
    p_setup.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p_run = sub.add_parser("run", help="train MaxText on a jaxspeed config's model")
    p_run.add_argument("config", type=Path)
    p_run.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a jaxspeed config key")
    p_run.add_argument("--python", default=str(DEFAULT_VENV / "bin" / "python"))
    p_run.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.command == "setup":
        python = setup(args.venv)
        print(f"MaxText {VERSION} ready: use --maxtext {python}")
        return 0
    _common.use_cpu_devices()  # the mesh's `-1` sizes resolve against 8 devices, as MaxText's do
    from jaxspeed.config import load_config

    opts = options(load_config(args.config, overrides=args.overrides))
    print(json.dumps({"options": opts, "step_seconds": run(args.python, opts, steps=args.steps)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
