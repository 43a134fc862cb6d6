#!/usr/bin/env bash
# Issue 42's MoE target by the shared recipe (../shared/tools/slow_link.sh, DEV=2): the MoE GPT
# with its expert axis across 2 hosts x 2 devices at 100 Mbit/s, one run per strategy, one after
# another, and each one's ratio to the flat exchange of the same build. `slow_network.py` is the
# full benchmark (calibration, predictions, its own link); this is the recipe's second opinion.
#
#   CLUSTER=FILE [MB=2] [STEPS=30] [OUT=DIR] bash benchmarks/moe_slow_link.sh
# CLUSTER: the link as `calibrate` measured it, for `parallelism: auto` (slow_network.py --out
# DIR writes DIR/cluster.rank0.yaml). RECIPE: where the shared recipe is (default
# ../shared/tools/slow_link.sh). Run as root from the repository root, on a quiet machine.
set -euo pipefail
: "${CLUSTER:?set CLUSTER to a calibrated cluster file (slow_network.py --out DIR: DIR/cluster.rank0.yaml)}"
[ -f "$CLUSTER" ] || { echo "moe_slow_link: no cluster file $CLUSTER" >&2; exit 2; }
MB=${MB:-2} STEPS=${STEPS:-30} OUT=${OUT:-$(mktemp -d /tmp/moe_slow_link.XXXX)}
RECIPE=${RECIPE:-../shared/tools/slow_link.sh}
mkdir -p "$OUT"
[ -f "$RECIPE" ] || { echo "moe_slow_link: $RECIPE not found (run from the repository root)" >&2; exit 2; }
base=(--set mesh.expert=4 --set mesh.data=1 --set "train_micro_batch_size_per_device=$MB")
hier=(--set model.moe.all_to_all=hierarchical --set model.moe.a2a_chunks=auto)
declare -A runs=(
  [flat]=""
  [flat_compiler]="--set zero_optimization.collectives=compiler"
  [hierarchical]="${hier[*]}"
  [auto]="${hier[*]} --set model.moe.parallelism=auto --set model.moe.cluster=$CLUSTER"
)
for name in flat flat_compiler hierarchical auto; do
  echo "== $name (micro batch $MB, $STEPS steps)"
  # shellcheck disable=SC2086  # the options are words
  DEV=2 bash "$RECIPE" 100 configs/gpt_moe.yaml "$STEPS" "$OUT/$name" "${base[@]}" ${runs[$name]} \
    | tee "$OUT/$name.txt" | tail -n 1
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
tps = {}
for name in ("flat", "flat_compiler", "hierarchical", "auto"):
    lines = [l for l in (out / f"{name}.txt").read_text().splitlines() if l.startswith("{")]
    tps[name] = json.loads(lines[-1])["median_tokens_per_second_last_half"] if lines else None
for name, value in tps.items():
    ratio = f"{value / tps['flat']:.2f}x flat" if value and tps["flat"] else "-"
    old = f", {value / tps['flat_compiler']:.2f}x flat_compiler" if value and tps["flat_compiler"] else ""
    print(f"{name:14s} {value or float('nan'):10,.1f} tokens/s  {ratio}{old}")
PY
