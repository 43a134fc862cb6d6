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
from jaxspeed.train.engine import initialize
from jaxspeed.errors import JaxspeedError
from jaxspeed.gpu import deviceless, targets
from jaxspeed.runtime.mesh import make_mesh
from pallas_kernels import backend as _backend

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
    assert main(["plan", str(config), "--auto", "--cluster", "8xh100-nvlink", "--target", "h100"]) == 2
    assert "do not go with --auto" in capsys.readouterr().err


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


#: Kernels each config's GPU program must call: the MoE dispatch/combine inside the expert-
#: parallel shard_map (Mosaic GPU on Hopper, Triton on an A100).
KERNELS = {("gpt_moe", "h100"): "mosaic_gpu_v2", ("gpt_moe", "a100"): "__gpu$xla.gpu.triton"}


@needs_gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize(("name", "target"), [(c, "h100") for c in CONFIGS] + [("gpt_moe", "a100")])
def test_the_train_step_compiles_for_8_gpus(name, target, capsys):
    config = load_config(f"configs/{name}.yaml")
    start = time.perf_counter()
    engine = initialize(config, mesh=make_mesh(config.mesh, devices=deviceless.devices(target, 8)))
    report = engine.memory_report()
    seconds = time.perf_counter() - start
    per = report["per_device_bytes"]
    assert report["source"] == "compiled-gpu" and 0 < per["device"] < 2**30
    if (name, target) in KERNELS:
        assert KERNELS[name, target] in _custom_calls(engine.compile_train_step())
    with capsys.disabled():  # the figures the issue note records
        print(f"\n{name}: 8 x {target} device bytes {per['device']} (temp {per['temp']}), "
              f"compiled in {seconds:.1f} s")


# ---- jaxspeed's ops pick the kernels of the device compiled for ----------------------------


def _custom_calls(compiled) -> set[str]:
    return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


@needs_gpu_compile
@pytest.mark.parametrize(("target", "call"), [("h100", "mosaic_gpu_v2"), ("h200", "mosaic_gpu_v2"),
                                              ("a100", "__gpu$xla.gpu.triton")])
def test_sparse_attention_and_its_gradient_compile_to_the_targets_kernels(target, call):
    import numpy as np

    import jaxspeed as js

    layout = js.attention.FixedSparsityConfig(num_heads=2, block=64).make_layout(512)
    x = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = js.attention.block_sparse_attention(q, k, v, layout, causal=True)
        return out.astype(jnp.float32).sum()

    compiled = compile_for_gpu(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, x, x, target=target)
    assert _custom_calls(compiled) & {"mosaic_gpu_v2", "__gpu$xla.gpu.triton"} == {call}
    assert compiled.as_text().count(f'custom_call_target="{call}"') == 3  # fwd, dq, dk/dv
    assert np.shape(layout)[0] == 2


@needs_gpu_compile
@pytest.mark.parametrize(("target", "call"), [("h100", "mosaic_gpu_v2"), ("a100", "__gpu$xla.gpu.triton")])
def test_the_moe_layer_compiles_to_the_targets_kernels(target, call):
    from jaxspeed.moe.layer import MoE

    layer = MoE(num_experts=4, d_ff=256, k=2, capacity_factor=1.0, use_rts=False)
    x = jax.ShapeDtypeStruct((2, 64, 256), jnp.bfloat16)
    params = jax.eval_shape(lambda: layer.init({"params": jax.random.key(0)}, jnp.zeros(x.shape, x.dtype)))

    def loss(params, x):
        return layer.apply(params, x, mutable=True)[0].astype(jnp.float32).sum()

    compiled = compile_for_gpu(jax.grad(loss, argnums=(0, 1)), params, x, target=target)
    assert call in _custom_calls(compiled)


def test_users_never_see_jaxs_triton_deprecation():
    """Lowering the Triton kernels (an A100) warns inside JAX; jaxspeed filters that warning
    (pytest's own warning capture resets filters, so this runs as a user's script would)."""
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, 'tests'); import jax, jax.numpy as jnp, numpy as np\n"
        "from gpu_lowering import lower_for_cuda\n"
        "from pallas_kernels import block_sparse_attention as attention\n"
        "x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)\n"
        "text = lower_for_cuda(lambda q, k, v: attention(q, k, v, np.ones((1, 4, 4))), x, x, x,\n"
        "                      device_kind='NVIDIA A100-SXM4-80GB')\n"
        "assert 'triton' in text\n"
    )
    proc = subprocess.run([sys.executable, "-W", "always", "-c", script], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "deprecated" not in proc.stderr


# ---- what the GPU benchmarks launch, at their GPU sizes ------------------------------------


def _benchmark(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_gpu_compile
@pytest.mark.slow
def test_gpu_sparse_attention_programs_compile_for_h200():
    """`benchmarks/gpu_sparse_attention.py`'s kernels at its GPU sizes (its shortest sequence):
    the Mosaic GPU kernel and the Triton one it is timed against, forward and fwd+bwd."""
    bench = _benchmark("gpu_sparse_attention")
    case = bench.GPU_CASE
    seq = case["seqs"][0]
    x = jax.ShapeDtypeStruct((case["batch"], seq, case["heads"], case["head_dim"]), jnp.bfloat16)
    layout = bench.fixed_layout(seq, block=case["block"], num_local_blocks=case["local"])
    with jax.default_device(gpu_device("h200")):
        fns = bench.attention_fns(layout, interpret=False)
        assert "triton" in fns  # Hopper: timed beside the Mosaic kernel
        for name, want in (("sparse", "mosaic_gpu_v2"), ("triton", "__gpu$xla.gpu.triton")):
            forward, with_grad = fns[name]
            assert want in _custom_calls(forward.lower(x, x, x).compile())
            assert want in _custom_calls(with_grad.lower(x, x, x, x).compile())


@needs_gpu_compile
@pytest.mark.slow
def test_gpu_moe_kernels_compile_for_h200_at_the_bandwidth_size():
    """`benchmarks/gpu_moe.py`'s bandwidth case (T 32768, M 4096, E 64, top-2, bf16): the
    Mosaic GPU dispatch/combine, and the Triton ones at every block size it times."""
    from jaxspeed.moe import top_k_gating
    from pallas_kernels import moe_kernels

    case = _benchmark("gpu_moe").GPU_CASE["bandwidth"]
    tokens, width, experts, k = case["tokens"], case["d_model"], case["experts"], case["k"]
    logits = jax.ShapeDtypeStruct((tokens, experts), jnp.float32)
    capacity = jax.eval_shape(lambda l: top_k_gating(l, k, case["capacity_factor"]), logits).capacity
    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((experts, capacity, width), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((tokens, k), jnp.int32)
    w = jax.ShapeDtypeStruct((tokens, k), jnp.float32)
    variants = [("mosaic_gpu", {}, "mosaic_gpu_v2")] + [
        ("triton", dict(block_rows=r, block_cols=c), "__gpu$xla.gpu.triton") for r, c in case["blocks"]]
    with jax.default_device(gpu_device("h200")):
        for backend, blocks, want in variants:
            dispatch = jax.jit(lambda x, e, p, b=backend, o=blocks: moe_kernels.moe_dispatch(
                x, e, p, experts, capacity, backend=b, **o))
            combine = jax.jit(lambda y, e, p, w, b=backend, o=blocks: moe_kernels.moe_combine(
                y, e, p, w, backend=b, **o))
            assert want in _custom_calls(dispatch.lower(x, idx, idx).compile())
            assert want in _custom_calls(combine.lower(y, idx, idx, w).compile())


@needs_gpu_compile
@pytest.mark.slow
def test_gpu_moe_layers_compile_for_h200():
    """`benchmarks/gpu_moe.py`'s headline layer case (its most experts): the Pallas layer
    (Mosaic GPU kernels) and the two layers it is timed against, forward and backward. (The
    other expert shapes differ only in sizes; compiling them too costs a minute of CI.)"""
    bench = _benchmark("gpu_moe")
    layer = bench.GPU_CASE["layer"]
    with jax.default_device(gpu_device("h200")):
        steps = bench.layer_steps(layer)
        for experts, hidden in layer["experts"][-1:]:
            args = jax.eval_shape(lambda e=experts, h=hidden: bench.moe_layer.make_inputs(
                layer, e, h, "bfloat16"))
            for name, step in steps.items():
                calls = _custom_calls(step.lower(*args).compile())
                assert ("mosaic_gpu_v2" in calls) == (name == "pallas"), (name, calls)


@needs_gpu_compile
@pytest.mark.slow
def test_gpu_offload_modes_compile_for_h200():
    """`benchmarks/gpu_offload.py`'s two suite modes at its 1.3B model on one H200: all in
    device memory, and everything offloaded with the layers streamed. (Before this compile
    the streamed mode could not trace for a GPU: `offload.to_device` left its values typed as
    host memory, which XLA:CPU's types never show.)"""
    bench = _benchmark("gpu_offload")
    report = {}
    for mode in ("device", "all_host"):
        config = bench.bench_config(mode, bench.FULL_MODEL)
        devices = deviceless.devices("h200", 1)
        report[mode] = initialize(config, mesh=make_mesh(config.mesh, devices=devices)).memory_report()
    device, offloaded = (report[m]["per_device_bytes"] for m in ("device", "all_host"))
    assert report["all_host"]["sources"]["device"] == "compiled"  # XLA:GPU separates host memory
    assert offloaded["host"] > device["params"] and offloaded["device"] < device["device"] / 2
    assert device["device"] < targets.load("h200").memory_bytes


@needs_gpu_compile
@pytest.mark.slow
def test_blocked_attention_gpu_paths_compile_for_h200():
    """`benchmarks/blocked_attention.py --gpu`'s three paths at seq 32768, bf16: the blocked
    one stays O(seq * block) in scratch, the dense reference does not."""
    bench = _benchmark("blocked_attention")
    case = bench.GPU
    x = jax.ShapeDtypeStruct((case["batch"], case["seq"], case["heads"], case["head_dim"]),
                             jnp.bfloat16)
    temp = {}
    with jax.default_device(gpu_device("h200")):
        for name, step in bench.steps(case).items():
            temp[name] = step.lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes
    scores = case["batch"] * case["heads"] * case["seq"] ** 2 * 4  # fp32 [b, h, L, L]
    assert temp["reference"] >= scores > 8 * temp["blocked"]


@needs_gpu_compile
@pytest.mark.slow
def test_gpu_engine_steps_compile_for_h200():
    """`benchmarks/gpu_engine.py`'s two engines at their GPU sizes on one H200: the overhead
    case's GPT (12 x 1024, seq 1024, micro 16) and the throughput case's tiny Llama."""
    bench = _benchmark("gpu_engine")
    overhead = _benchmark("overhead")
    configs = (overhead.bench_config(bench.GPU_CASE["overhead"]),
               bench.throughput_config(bench.GPU_CASE["throughput"]))
    for config in configs:
        devices = deviceless.devices("h200", 1)
        report = initialize(config, mesh=make_mesh(config.mesh, devices=devices)).memory_report()
        assert report["source"] == "compiled-gpu"
        assert 0 < report["per_device_bytes"]["device"] < targets.load("h200").memory_bytes


# ---- FP8: every projection's GEMMs read FP8 operands on the GPU -----------------------------


def _fp8_gemm_flops(text: str) -> tuple[int, int]:
    """(FLOPs of the dots that read FP8 operands, FLOPs of the others), per run, per device."""
    from jaxspeed.cost import hlo

    fp8, other = 0, 0
    for dot in hlo.dots(text):
        flops = dot.flops * dot.executions
        if any(dtype.startswith("f8") for dtype in dot.dtypes[:2]):
            fp8 += flops
        else:
            other += flops
    return fp8, other


@needs_gpu_compile
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_train_step_runs_every_projection_gemm_in_fp8_on_h100(recipe):
    """The FP8 step of `configs/gpt_zero3.yaml` for 8 x H100: the FLOPs of the dots reading f8
    operands (XLA:GPU's GEMM fusions; cuBLASLt's FP8 calls would be custom calls, none here)
    are exactly those of the projections' three GEMMs (forward, input and weight gradients)
    in every layer, so a single GEMM silently left in bf16 fails it."""
    config = load_config("configs/gpt_zero3.yaml",
                         overrides=["fp8.enabled=true", f"fp8.recipe={recipe}"])
    engine = initialize(config, mesh=make_mesh(config.mesh, devices=deviceless.devices("h100", 8)))
    text = engine.compile_train_step().as_text()
    m = config.model
    tokens = config.train_micro_batch_size_per_device * config.data.seq_len
    projections = 4 * m.d_model**2 + 2 * m.d_model * m.d_ff  # q, k, v, out; wi, wo
    fp8, other = _fp8_gemm_flops(text)
    assert fp8 == 3 * 2 * tokens * projections * m.n_layers
    assert "__cublas$lt$matmul" not in text.replace("__cublas$lt$matmul$f8", "")
    # What stays in bf16/fp32: attention (q.k and p.v forward, four dots backward, causal
    # masking computes the whole square) and the LM head's three GEMMs.
    attention = 6 * 2 * tokens * config.data.seq_len * m.d_model * m.n_layers
    head = 3 * 2 * tokens * m.d_model * m.vocab_size
    assert other == attention + head


@needs_gpu_compile
def test_fp8_all_gather_gathers_the_layers_weights_in_fp8_on_h100():
    """`zero_optimization.fp8_all_gather`: ZeRO-3's gathers of the projection weights move
    f8e4m3fn (one byte a weight) where the bf16 step, also gathering at each use, moves two;
    the rest (norms, embedding, the scales) stays as it was. `plan` reads the same bytes
    (`hlo.collective_bytes`)."""
    from jaxspeed.cost import hlo

    def gathered(*overrides):
        config = load_config("configs/gpt_zero3.yaml", overrides=list(overrides))
        engine = initialize(config,
                            mesh=make_mesh(config.mesh, devices=deviceless.devices("h100", 8)))
        text = engine.compile_train_step().as_text()
        return config, text, hlo.collective_bytes(text, num_devices=8)["all-gather"]

    config, _, bf16 = gathered("zero_optimization.max_live_parameters=0")
    _, text, fp8 = gathered("fp8.enabled=true", "zero_optimization.fp8_all_gather=true")
    assert any("all-gather" in line and "f8e4m3fn" in line for line in text.splitlines())
    m = config.model
    projections = (4 * m.d_model**2 + 2 * m.d_model * m.d_ff) * m.n_layers
    total = projections + m.vocab_size * m.d_model + (2 * m.n_layers + 1) * m.d_model
    # Each weight's gather at one byte instead of two; the scales' 4 bytes a tensor aside.
    want = (projections + 2 * (total - projections)) / (2 * total)
    assert fp8 / bf16 == pytest.approx(want, rel=0.02)
