"""`jaxspeed plan --target`'s predicted step (`jaxspeed.cost.roofline`) on a program XLA:GPU
compiled without a GPU: a 2-layer model of `configs/llama_1b.yaml`'s shape (grouped-query
attention, SwiGLU, RMSNorm, Llama 3 rotary), one H100. Needs the gpu-compile extra."""

import json

import jax
import jax.numpy as jnp
import pytest
from gpu_compile import compile_for_gpu, needs_gpu_compile

from jaxspeed.attention.block_sparse import CAUSAL_BLOCKS, causal_attention
from jaxspeed.cli import main
from jaxspeed.cost import roofline
from jaxspeed.config import load_config
from jaxspeed.cost.flops import model_train_flops
from jaxspeed.cost.peaks import GPU_PEAKS
from jaxspeed.cost.plan_table import format_roofline

#: llama_1b's keys, at a size that compiles in seconds
TINY_LLAMA = ["model.vocab_size=512", "model.d_model=256", "model.n_layers=2", "model.n_heads=4",
              "model.n_kv_heads=2", "model.d_ff=512", "model.max_seq_len=256", "data.seq_len=256",
              "train_micro_batch_size_per_device=2"]


def plan(capsys, *extra: str) -> str:
    args = ["plan", "configs/llama_1b.yaml", "--target", "h100", "--devices", "1", *extra]
    for override in TINY_LLAMA:
        args += ["--set", override]
    assert main(args) == 0
    return capsys.readouterr().out


@needs_gpu_compile
def test_plan_json_predicts_step_time_mfu_and_hfu(capsys):
    report = json.loads(plan(capsys, "--json"))
    seconds, mfu = report["predicted_step_seconds"], report["predicted_mfu"]
    assert 0 < seconds < 1 and 0 < mfu < 1 and 0 < report["predicted_hfu"] < 1
    config = load_config("configs/llama_1b.yaml", overrides=TINY_LLAMA)
    model = model_train_flops(config.model, tokens=2 * 256, seq_len=256, param_count=0)
    assert report["model_flops"] == pytest.approx(model)
    assert mfu == pytest.approx(model / seconds / GPU_PEAKS["H100"].bf16)
    # the program's matmuls: every projection, forward and backward, at least 6N per token
    assert report["program_flops"] >= 0.9 * model
    by_bound = report["seconds_by_bound"]
    assert sum(by_bound.values()) == pytest.approx(seconds) and by_bound["link"] == 0
    top = report["top_ops"]
    assert top and all(op["seconds"] > 0 for op in top)
    assert [op["seconds"] for op in top] == sorted((op["seconds"] for op in top), reverse=True)
    # what the text output prints under the memory table (one compile for both: CI's budget)
    text = "\n".join(format_roofline(report))
    assert f"predicted step {seconds * 1e3:.1f} ms" in text and f"MFU {mfu:.1%}" in text
    assert "HFU" in text and top[0]["name"] in text


@needs_gpu_compile
def test_pallas_attention_kernels_are_priced_by_the_flops_they_declare():
    """Our Mosaic GPU attention kernels declare their FLOPs (`pl.CostEstimate`); the roofline
    prices each custom call by them: 2 + 3 + 4 block matmuls (forward, dq, dk/dv) per set
    block of the causal layout, not by its bytes alone."""
    batch, seq, heads, head_dim = 2, 1024, 4, 64
    x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        out = causal_attention(q, k, v, impl="pallas")
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    text = compile_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), x, x, x).as_text()
    peaks = GPU_PEAKS["H100"]
    kernels = [op for op in roofline.op_costs(text, peaks=peaks, hbm=3.35e12)
               if op.kind == "kernel"]
    assert len(kernels) == 3  # forward, dq, dk/dv
    block = CAUSAL_BLOCKS[0]
    blocks = seq // block
    products = batch * heads * blocks * (blocks + 1) // 2 * block * block
    assert sum(op.flops * op.executions for op in kernels) == 2 * 9 * products * head_dim
    for op in kernels:
        assert op.seconds >= op.flops / (peaks.bf16 * roofline.MATMUL_EFFICIENCY)


@needs_gpu_compile
def test_loops_of_unknown_trip_count_are_counted_and_named(capsys):
    """`attention.impl: blocked`'s causal inner loops run a data-dependent number of times:
    the report counts them (each priced once) and says the prediction is a lower bound; the
    config's Pallas kernel leaves none."""
    blocked = json.loads(plan(capsys, "--json", "--set", "model.attention.impl=blocked",
                              "--set", "model.attention.block_q=64",
                              "--set", "model.attention.block_kv=64"))
    assert blocked["unknown_trip_loops"] >= 2  # forward and backward, in each layer's body
    assert "priced at one trip each" in "\n".join(format_roofline(blocked))
    kernel = json.loads(plan(capsys, "--json"))  # configs/llama_1b.yaml: impl pallas
    assert kernel["unknown_trip_loops"] == 0
