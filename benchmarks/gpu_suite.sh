#!/usr/bin/env bash
# Every GPU check in one script, in two device calls of under 10 minutes on one H100/H200.
#
#   benchmarks/gpu_suite.sh            on a GPU: first gpu_mfu (llama_1b's tokens/s, MFU and
#                                      HFU in bf16 and FP8, with the config's attention and
#                                      cuDNN's, 50 steps each) and tokamax (tokamax_compare.py:
#                                      its attention and ragged_dot kernels against ours, carried
#                                      wheels); then (a) the Pallas kernels, compiled (not
#                                      interpreted), against their jnp references: forward and
#                                      gradients, fp32 and bf16; (b) gpu_engine,
#                                      gpu_sparse_attention, gpu_moe and gpu_offload, each with
#                                      its baseline measured in the same run, and
#                                      blocked_attention --gpu (cuDNN fused vs blocked vs the
#                                      dense reference, seq 32k, bf16)
#   benchmarks/gpu_suite.sh --dry-run  anywhere: every kernel lowered for cuda (abstract GPU
#                                      device) and, with the gpu-compile extra installed,
#                                      compiled by XLA:GPU for H100/H200/A100 without a GPU with
#                                      every block configuration impl="auto" can pick, the
#                                      Mosaic GPU kernels run in GPU interpret mode (race
#                                      detection on), the train steps of the six GPU configs
#                                      compiled for 8 x H100; the kernel tests (a) would run
#                                      listed, and each benchmark at tiny sizes on the CPU with
#                                      the options (b) uses; first, gpu_mfu --dry-run: llama_1b
#                                      compiled for one H100, its predicted step and MFU
#
# Each part runs under `timeout` (the limits add up to 1145 s: two device calls, see the budget
# below), so a run ends on time whatever hangs; a part that fails or runs out of time is named and the rest still
# run, and ONLY=kernels,gpu_moe (part names, comma-separated) reruns just those. Each part's wall time is printed, to rebalance the limits after a real run. PYTHON picks
# the interpreter (default: .venv/bin/python, else python3). Results go to $OUT (the device
# tool's output folder) or runs/gpu_suite: a log per part and results.jsonl, every benchmark's
# JSON lines (8 files at most: the device tool brings back 8).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=${OUT:-runs/gpu_suite}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1  # a part stopped by its timeout keeps what it printed
failed=()
bench_logs=()

part() {  # part NAME TIMEOUT_S COMMAND...: runs one part, keeps its log, goes on after a failure
  local name=$1 limit=$2 start=$SECONDS status; shift 2
  case ",${ONLY:-$name}," in *",$name,"*) ;; *) return 0 ;; esac
  timeout -k 2 "$limit" "$@" >"$DEST/$name.log" 2>&1
  status=$?
  case $name in gpu_*|tokamax) bench_logs+=("$DEST/$name.log") ;; esac
  if [ $status -eq 0 ]; then
    echo "== $name: ok in $((SECONDS - start)) s"; tail -n 1 "$DEST/$name.log"
  else
    case $status in 124|137) why="timed out after $limit s" ;; *) why="exit $status" ;; esac
    echo "== $name: FAILED ($why) in $((SECONDS - start)) s; last lines:"
    tail -n 5 "$DEST/$name.log"; failed+=("$name")
  fi
}

# (a) selects the kernels' tests by name: every test of a Pallas kernel except the lowering ones.
# On Hopper these run the Mosaic GPU kernels (Triton on older GPUs): the backend follows the
# device, and each test compares the compiled kernels with the jnp references.
KERNEL_TESTS=(tests/test_block_sparse_attention.py tests/test_moe_dispatch.py)
KERNEL_SELECT="pallas and not lowers"
# What the dry run compiles for GPUs that are not here (tests that skip without the plugin).
COMPILE_TESTS=(tests/test_gpu_compile.py tests/test_block_sparse_attention_mgpu.py
               tests/test_moe_kernels_mgpu.py)
# (b)'s options, shared by both runs so that the dry run checks them. gpu_offload runs the
# baseline mode and the headline mode only: its four modes are four processes that each start,
# compile and train, more than the budget holds.
OFFLOAD_ARGS=(--modes device all_host --steps 3)

case "${1:-}" in
--dry-run)
  part gpu_mfu 600 "$PY" benchmarks/gpu_mfu.py --dry-run
  part lowering 600 "$PY" -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" -k lowers
  part compiles 600 "$PY" -m pytest -q -p no:cacheprovider -n 2 -m gpu_compile "${COMPILE_TESTS[@]}"
  part kernels 600 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${KERNEL_TESTS[@]}" \
    -k "$KERNEL_SELECT"
  part gpu_engine 600 "$PY" benchmarks/gpu_engine.py --cpu-check
  part gpu_sparse_attention 600 "$PY" benchmarks/gpu_sparse_attention.py --quick
  part gpu_moe 600 "$PY" benchmarks/gpu_moe.py --cpu-check
  part gpu_offload 600 "$PY" benchmarks/gpu_offload.py --quick "${OFFLOAD_ARGS[@]}"
  part gpu_attention 600 "$PY" benchmarks/blocked_attention.py --gpu --cpu-check
  ;;
"")
  # Budget (s), compile times included: preflight 20 + gpu_mfu 420 + tokamax 150 + kernels 70 +
  # gpu_engine 75 + gpu_sparse_attention 70 + gpu_moe 200 + gpu_offload 110 + gpu_attention 30 =
  # 1145: more than one device call (600 s) and than a session's lease (900 s). Run it as two
  # calls, `ONLY=gpu_mfu,tokamax` then the rest, or the rest in a later lease. gpu_mfu is four
  # 1B cases (bf16, FP8, each again with cuDNN's attention), each a process of its own
  # (start, compile, 50 steps of about 0.5 s). The first H200 run (2026-12-04) took kernels 27,
  # gpu_engine 41, gpu_sparse_attention 37, gpu_attention 15, gpu_moe about 130; the second,
  # on another H200, kernels 45 and gpu_engine 56 (compiles 1.4-1.7x slower).
  timeout -k 2 20 "$PY" - <<'EOF' || { echo "gpu_suite.sh: preflight failed" >&2; exit 2; }
import sys
try:
    import chex, jax, pytest  # noqa: F401
    import jaxspeed.train.engine, jaxspeed.train.loop  # noqa: F401
    from pallas_kernels.backend import on_gpu
except ModuleNotFoundError as err:
    sys.exit(f"gpu_suite.sh: Python module {err.name!r} is missing for {sys.executable}; "
             "carry its wheels and put them on PYTHONPATH (see the device tool's notes)")
if not on_gpu():
    sys.exit(f"gpu_suite.sh: no GPU here (JAX sees {jax.devices()}); use --dry-run")
print("jax", jax.__version__, "on", jax.devices()[0].device_kind)
EOF
  # The tests' conftest defaults to the CPU and to XLA's fast-compile flags; here they run on
  # the GPU, compiled as a user's program is. Their error model (tests/numerics.py) takes fp32
  # matmuls as fp32 sums of fp32 products; XLA and Triton default to TF32 inputs on the GPU,
  # so fp32 runs at "highest" precision (bf16 operands are unaffected).
  part gpu_mfu 420 "$PY" benchmarks/gpu_mfu.py
  part tokamax 150 "$PY" benchmarks/tokamax_compare.py
  part kernels 55 env JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest \
    JAXSPEED_TEST_XLA_OPT=default "$PY" -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" \
    -k "$KERNEL_SELECT"
  part gpu_engine 65 "$PY" benchmarks/gpu_engine.py
  part gpu_sparse_attention 50 "$PY" benchmarks/gpu_sparse_attention.py
  part gpu_moe 160 "$PY" benchmarks/gpu_moe.py
  part gpu_offload 90 "$PY" benchmarks/gpu_offload.py "${OFFLOAD_ARGS[@]}"
  part gpu_attention 25 "$PY" benchmarks/blocked_attention.py --gpu
  ;;
*) echo "usage: benchmarks/gpu_suite.sh [--dry-run]" >&2; exit 2 ;;
esac

grep -h '^{' "${bench_logs[@]}" </dev/null >"$DEST/results.jsonl" 2>/dev/null || true
echo "== $(wc -l < "$DEST/results.jsonl") result lines in $DEST/results.jsonl; $SECONDS s in all"
[ ${#failed[@]} -eq 0 ] || { echo "gpu_suite.sh: failed: ${failed[*]}" >&2; exit 1; }
