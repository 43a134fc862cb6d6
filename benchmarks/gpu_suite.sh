#!/usr/bin/env bash
# Every GPU check in one script, for a lent GPU machine's short budget (about 15 minutes).
#
#   benchmarks/gpu_suite.sh            on a GPU: the kernels against their jnp references
#                                      (compiled, not interpreted), then each GPU benchmark
#   benchmarks/gpu_suite.sh --dry-run  anywhere: lowers every Pallas kernel for cuda (abstract
#                                      GPU device) and runs each GPU benchmark's CPU smoke check
#
# PYTHON picks the interpreter (default: .venv/bin/python, else python3). Results: one log per
# part and the benchmarks' JSON lines in $OUT (the device tool's output folder) or runs/gpu_suite.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=${OUT:-runs/gpu_suite}
mkdir -p "$DEST"
failed=()

part() {  # part NAME TIMEOUT_S COMMAND...: runs one part, keeps its log, goes on after a failure
  local name=$1 limit=$2; shift 2
  echo "== $name"
  if timeout "$limit" "$@" >"$DEST/$name.log" 2>&1; then
    tail -n 1 "$DEST/$name.log"
  else
    echo "   FAILED (exit $?); last lines:"; tail -n 5 "$DEST/$name.log"; failed+=("$name")
  fi
}

KERNEL_TESTS=(tests/test_block_sparse_attention.py tests/test_moe_dispatch.py tests/test_moe_experts.py)
case "${1:-}" in
--dry-run)
  part lowering 600 "$PY" -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" -k lowers
  part gpu_moe 600 "$PY" benchmarks/gpu_moe.py --cpu-check
  part gpu_sparse_attention 600 "$PY" benchmarks/gpu_sparse_attention.py --quick
  part gpu_offload 600 "$PY" benchmarks/gpu_offload.py --quick
  ;;
"")
  "$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.__version__, jax.devices())' \
    || { echo "gpu_suite.sh: no GPU here; use --dry-run" >&2; exit 2; }
  # The tests' conftest defaults JAX_PLATFORMS to cpu; here they run on the GPU.
  part kernels 240 env JAX_PLATFORMS=cuda "$PY" -m pytest -q -p no:cacheprovider -x "${KERNEL_TESTS[@]}"
  part gpu_moe 150 "$PY" benchmarks/gpu_moe.py
  part gpu_sparse_attention 120 "$PY" benchmarks/gpu_sparse_attention.py
  part gpu_engine 120 "$PY" benchmarks/gpu_engine.py
  part gpu_offload 120 "$PY" benchmarks/gpu_offload.py
  ;;
*) echo "usage: benchmarks/gpu_suite.sh [--dry-run]" >&2; exit 2 ;;
esac

grep -h '^{' "$DEST"/*.log > "$DEST/results.jsonl" 2>/dev/null || true
[ ${#failed[@]} -eq 0 ] || { echo "gpu_suite.sh: failed: ${failed[*]}" >&2; exit 1; }
