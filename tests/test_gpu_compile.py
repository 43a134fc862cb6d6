"""The GPU half without a GPU: shipped targets, the kernel backend per target, and XLA:GPU
compiling the real train steps for 8 x H100 (`jaxspeed plan --target`).

The tests marked `needs_gpu_compile` need the `gpu-compile` extra (the CUDA plugin at jaxlib's
version, ptxas and libdevice); `make test-gpu-compile` installs it in a venv of its own and runs
them, and CI runs that step. The rest run everywhere.
"""

import json
import re
import time

import jax
import jax.numpy as jnp
import pytest
from gpu_compile import compile_for_gpu, gpu_device, needs_gpu_compile

from jaxspeed.cli import main
from jaxspeed.config import load_config
from jaxspeed.engine import initialize
from jaxspeed.errors import JaxspeedError
from jaxspeed.gpu import deviceless, targets
from jaxspeed.mesh import make_mesh
from pallas_kernels import _backend

CONFIGS = ("gpt_zero3", "gpt_tp2_zero3", "gpt_3d", "gpt_moe", "gpt_sparse", "gpt_long")
TINY = {
    "mesh": {"data": -1},
    "train_micro_batch_size_per_device": 1,
    "zero_optimization": {"stage": 3},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "data": {"seq_len": 32},
}


# ---- targets -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_every_target_value_names_its_source(name):
    target = targets.load(name)
    block = target.text.split("gpu_device_info {", 1)[1].split("\n}", 1)[0]
    values = [line for line in block.splitlines() if re.match(r"\s+\w+\s*[:{]", line)]
    assert len(values) >= 18
    unsourced = [line for line in values if not re.search(r"#\s*\[[A-Z]+\]", line)]
    assert not unsourced, f"values without a source: {unsourced}"
    cited = set(re.findall(r"#\s*\[([A-Z]+)\]", block))
    header = target.text.split("gpu_device_info", 1)[0]
    assert all(f"[{tag}]" in header for tag in cited), "every tag is explained in the header"


def test_targets_read_the_figures_jaxspeed_uses():
    h100, h200, a100 = (targets.load(n) for n in ("H100", "h200", "a100"))
    assert (h100.compute_capability, a100.compute_capability) == ((9, 0), (8, 0))
    assert h100.shared_memory_per_block_optin == h200.shared_memory_per_block_optin == 227 * 1024
    assert a100.shared_memory_per_block_optin == 163 * 1024
    assert h100.memory_bytes < a100.memory_bytes == 80 * 2**30 < h200.memory_bytes
    assert h200.device_kind == "NVIDIA H200" and h100.capability == "9.0"


def test_unknown_target_names_the_known_ones():
    with pytest.raises(JaxspeedError, match=r"unknown GPU target 'b300'; known targets: a100, h100, h200"):
        targets.load("b300")


def test_missing_plugin_is_one_line_with_the_fix(monkeypatch, capsys, tmp_path):
    def absent(name):
        raise deviceless.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(deviceless.importlib.metadata, "version", absent)
    assert deviceless.missing() == deviceless.INSTALL_HINT
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    assert main(["plan", str(config), "--target", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpu-compile" in err and "Traceback" not in err


def test_target_flags_are_checked(capsys, tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    assert main(["plan", str(config), "--devices", "8"]) == 2
    assert "--devices goes with --target or --cluster" in capsys.readouterr().err
    assert main(["plan", str(config), "--cluster", "v100-32g-x800"]) == 2
    assert "names no GPU" in capsys.readouterr().err
    assert main(["plan", str(config), "--target", "h100", "--devices", "12"]) == 2
    assert "whole hosts of 8" in capsys.readouterr().err


# ---- which kernel backend a target gets ----------------------------------------------------


def test_kernels_run_interpreted_on_cpu():
    assert _backend.target_device().platform == "cpu"
    assert _backend.kernel_backend() == _backend.INTERPRET and not _backend.on_gpu()


@pytest.mark.parametrize(
    ("kind", "backend"),
    [("NVIDIA H100 80GB HBM3", "mosaic_gpu"), ("NVIDIA H200", "mosaic_gpu"),
     ("NVIDIA GH200 480GB", "mosaic_gpu"), ("NVIDIA B200", "mosaic_gpu"),
     ("NVIDIA A100-SXM4-80GB", "triton"), ("Tesla V100-SXM2-32GB", "triton"),
     ("AMD Instinct MI300X", "triton")],
)
def test_abstract_devices_pick_by_compute_capability(kind, backend):
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    assert _backend.kernel_backend(device) == backend
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        assert _backend.kernel_backend() == backend  # the trace's target, not the host


@needs_gpu_compile
@pytest.mark.parametrize(("target", "backend"), [("h100", "mosaic_gpu"), ("h200", "mosaic_gpu"),
                                                 ("a100", "triton")])
def test_default_device_is_the_target(target, backend):
    with jax.default_device(gpu_device(target)):
        assert _backend.kernel_backend() == backend
        assert jax.jit(lambda x: x + 1).trace(1.0).jaxpr is not None  # traced on the host
    assert _backend.kernel_backend() == _backend.INTERPRET


# ---- deviceless compiles -------------------------------------------------------------------


@needs_gpu_compile
def test_a_bf16_matmul_compiles_for_h100_without_a_gpu():
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    compiled = compile_for_gpu(lambda a, b: a @ b, x, x)
    assert "cublas" in compiled.as_text() or "dot(" in compiled.as_text()
    assert compiled.memory_analysis().argument_size_in_bytes == 2 * 512 * 512 * 2


@needs_gpu_compile
def test_plan_target_reports_the_gpu_compile(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    assert main(["plan", str(config), "--target", "h100", "--devices", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["source"] == "compiled-gpu"
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert report["target"] == {"gpu": "h100", "device_kind": "NVIDIA H100 80GB HBM3",
                                "devices": 8, "cluster": None}
    per = report["per_device_bytes"]
    assert 0 < per["params"] <= per["total"] == per["device"] and report["host_bytes"] == 0
    # XLA:GPU forms the reduce-scatter that XLA:CPU never does (ZeRO-3's gradients)
    assert report["profile"]["collective_bytes"]["reduce-scatter"] > 0
    assert report["fit"]["fit"]["budget"] == targets.load("h100").memory_bytes
    assert report["fit"]["fit"]["fits"]
    assert main(["plan", str(config), "--cluster", "8xh100-nvlink"]) == 0
    text = capsys.readouterr().out
    assert "compiled for 8 x NVIDIA H100 80GB HBM3 without a GPU" in text
    assert re.search(r"device memory needed\s+\S+ \S+\s+compiled-gpu", text)
    assert "fits: " in text and "of 80.00 GiB" in text  # the preset's memory


@needs_gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_the_train_step_compiles_for_8_h100(name, capsys):
    config = load_config(f"configs/{name}.yaml")
    start = time.perf_counter()
    engine = initialize(config, mesh=make_mesh(config.mesh, devices=deviceless.devices("h100", 8)))
    report = engine.memory_report()
    seconds = time.perf_counter() - start
    per = report["per_device_bytes"]
    assert report["source"] == "compiled-gpu" and 0 < per["device"] < 2**30
    with capsys.disabled():  # the figures the issue note records
        print(f"\n{name}: 8 x H100 device bytes {per['device']} (temp {per['temp']}), "
              f"compiled in {seconds:.1f} s")
