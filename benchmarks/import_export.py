"""Hugging Face Llama import and export throughput, against reading the same files raw.

A random-weight Llama folder is written locally (no download): by default Llama 3.2 1B's
shapes (hidden 2048, 16 layers, 32 heads, 8 key/value heads, d_ff 8192, vocab 128256, tied
embeddings; 1.24B parameters) in its dtype, bfloat16 (`--dtype float32` doubles the bytes), as
1 GB safetensors shards with an index. Then, each repeated and the median taken:

- **raw**: `safetensors.numpy.load_file` of every shard (the files' bytes into numpy);
- **import**: `jaxspeed.checkpoint.hf.import_hf` (read, transpose, stack the layers, write the params
  checkpoint, complete on disk);
- **export**: `jaxspeed.checkpoint.hf.export_hf` of that checkpoint (read, transpose back, write the
  safetensors shards and index).

Throughput is the safetensors bytes over the wall time, in MB/s. Each line's ratio is the
conversion's throughput over the raw read's (higher is better); the target is >= 0.5. The
headline is the slower of import and export. Files are in the system temp folder (page cache
warm for every reader alike); each repeat's output is deleted before the next, so that the
page cache holds the same files for every measurement. `--quick` uses a few-MB model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "import_export"
FULL = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
        "shard_bytes": 1 << 30, "repeats": 3}
QUICK = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 1024,
         "shard_bytes": 256 << 10, "repeats": 2}
TARGET = 0.5


def write_random_llama(folder: Path, case: dict, dtype: str = "float32") -> int:
    """Writes config.json and random shards (with an index); returns the tensor bytes."""
    import numpy as np

    from jaxspeed.checkpoint.hf.convert import DTYPES

    from jaxspeed.checkpoint.hf import files as hf_files
    from jaxspeed.checkpoint.hf.config import hf_from_model
    from jaxspeed.checkpoint.hf.weights import hf_shapes

    model = {"vocab_size": case["vocab_size"], "d_model": case["hidden_size"],
             "n_layers": case["num_hidden_layers"], "n_heads": case["num_attention_heads"],
             "n_kv_heads": case["num_key_value_heads"], "d_ff": case["intermediate_size"],
             "max_seq_len": 2048, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rotary",
             "tie_embeddings": True, "rope_theta": 500_000.0, "rope_scaling": None,
             "rms_norm_eps": 1e-5}
    rng = np.random.default_rng(0)
    shapes = hf_shapes(model)
    tensors = {name: rng.random(shape, dtype=np.float32).astype(DTYPES[dtype], copy=False)
               for name, shape in shapes.items()}
    layout: dict[str, list[str]] = {}
    size, shard = 0, 0
    for name in shapes:  # HF's order: fill a shard up to shard_bytes, then start the next
        nbytes = tensors[name].nbytes
        if size and size + nbytes > case["shard_bytes"]:
            shard, size = shard + 1, 0
        layout.setdefault(shard, []).append(name)
        size += nbytes
    count = len(layout)
    files = {f"model-{i + 1:05d}-of-{count:05d}.safetensors": names for i, names in layout.items()}
    folder.mkdir(parents=True)
    hf_files.write_tensors(folder, tensors, files=files)
    hf_files.write_json(folder / hf_files.CONFIG, hf_from_model(model, dtype=dtype))
    return sum(t.nbytes for t in tensors.values())


def raw_read(folder: Path) -> None:
    from safetensors.numpy import load_file

    for path in sorted(folder.glob("*.safetensors")):
        load_file(str(path))


def median_seconds(fn, repeats: int, *, output=None) -> float:
    """The median wall time of `fn(i)`; `output(i)`, where given, is deleted after each repeat
    but the first (which later steps read)."""
    times = []
    for i in range(repeats):
        os.sync()  # start each with no dirty pages left by the last: it times this step's writes
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
        if output is not None and i:
            shutil.rmtree(output(i))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-MB model (tests)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the files' dtype (Llama 3.2 1B ships bfloat16)")
    args = parser.parse_args()
    case = QUICK if args.quick else FULL
    repeats = args.repeats or case["repeats"]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxspeed.checkpoint.hf import export_hf, import_hf

    work = Path(tempfile.mkdtemp(prefix="jaxspeed-import-export-"))
    try:
        source = work / "source"
        nbytes = write_random_llama(source, case, args.dtype)
        mb = nbytes / 1e6
        raw = median_seconds(lambda i: raw_read(source), repeats)
        imported = median_seconds(lambda i: import_hf(source, work / f"ckpt{i}"), repeats,
                                  output=lambda i: work / f"ckpt{i}")
        exported = median_seconds(lambda i: export_hf(work / "ckpt0", work / f"hf{i}"), repeats,
                                  output=lambda i: work / f"hf{i}")
        same = all((work / "hf0" / p.name).read_bytes() == p.read_bytes()
                   for p in source.iterdir() if p.suffix == ".safetensors")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = nbytes // (2 if args.dtype == "bfloat16" else 4)
    shape = (f"{params / 1e9:.2f}B params {args.dtype}, hidden {case['hidden_size']}, "
             f"{case['num_hidden_layers']} layers, vocab {case['vocab_size']}")
    rows, lines = [], []
    for what, seconds in (("import", imported), ("export", exported)):
        rate = mb / seconds
        rows.append([what, round(rate, 1), round(mb / raw, 1), _common.ratio(rate, mb / raw)])
        lines.append(_common.result(
            NAME, case=f"{what}: {shape}", jaxspeed=rate, baseline=mb / raw, unit="MB/s",
            ratio=_common.ratio(rate, mb / raw), seconds=round(seconds, 3),
            raw_seconds=round(raw, 3), mb=round(mb, 1), target=TARGET, round_trip_identical=same,
        ))
    print(f"{shape}: {mb:,.0f} MB of safetensors; median of {repeats}")
    _common.print_table(["", "MB/s", "raw read MB/s", "ratio"], rows)
    for line in lines:
        _common.print_json(line)
    slower = min(lines, key=lambda line: line["ratio"])
    _common.print_json({**slower, "case": f"slower of import/export ({slower['case']})"})


if __name__ == "__main__":
    main()
