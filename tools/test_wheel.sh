#!/usr/bin/env bash
# jaxspeed as a user installs it: build the wheel, install it into a clean venv outside the
# checkout, and run it from a folder there: the cluster presets (package data), `jaxspeed plan
# --auto --cluster 8xh100-nvlink` on a tiny config, a 2-step `jaxspeed train`, and `jaxspeed
# bench`'s one-line refusal (the benchmarks need the source checkout).
#
#   tools/test_wheel.sh PYTHON WORKDIR     # `make test-wheel` passes .venv's python
#
# The wheel is built from a copy of the sources (nothing is written into the checkout). The
# clean venv gets jax and the other dependencies from pip's cache when `make install` has
# filled it, so they are not downloaded twice.
set -euo pipefail
PY=${1:?usage: tools/test_wheel.sh PYTHON WORKDIR}
WORK=${2:?usage: tools/test_wheel.sh PYTHON WORKDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
case "$WORK/" in "$ROOT"/*) echo "test_wheel: $WORK is inside the checkout $ROOT" >&2; exit 2 ;; esac
rm -rf "$WORK/src" "$WORK/dist" "$WORK/venv" "$WORK/run"
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/run"

step() { echo "== test-wheel: $*"; }
step "build the wheel"
(cd "$ROOT" && tar --exclude=__pycache__ --exclude='*.egg-info' -cf - \
    pyproject.toml README.md jaxspeed pallas_kernels) | tar -xf - -C "$WORK/src"
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/jaxspeed-*.whl)
"$PY" - "$WHEEL" <<'PYEOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = {"jaxspeed/config/clusters/8xh100-nvlink.yaml", "jaxspeed/gpu/targets/h100.textproto"}
missing = sorted(need - names)
sys.exit(f"test_wheel: the wheel lacks {missing}" if missing else 0)
PYEOF

step "install it into a clean venv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install --quiet "$WHEEL"

cd "$WORK/run"
unset PYTHONPATH
"$VPY" - "$ROOT" <<'PYEOF'
import sys
import jaxspeed
from jaxspeed.config.cluster import available_presets
if jaxspeed.__file__.startswith(sys.argv[1] + "/"):
    sys.exit(f"test_wheel: jaxspeed was imported from the checkout ({jaxspeed.__file__})")
assert "8xh100-nvlink" in available_presets(), available_presets()
print("imported from", jaxspeed.__file__, "; presets:", ", ".join(available_presets()))
PYEOF
cat > tiny.yaml <<'YAML'
mesh: {data: -1}
train_batch_size: 8
zero_optimization: {stage: 1}
optimizer: {type: AdamW, params: {lr: 1.0e-3}}
model: {type: gpt, vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 2, d_ff: 128, max_seq_len: 64}
data: {source: stdlib, seq_len: 64, max_bytes: 200000}
logging: {every_n_steps: 1, eval_every_n_steps: 1000}
YAML
JS="$WORK/venv/bin/jaxspeed"

step "jaxspeed plan --auto --cluster 8xh100-nvlink"
"$JS" plan tiny.yaml --auto --cluster 8xh100-nvlink --cpu-devices 8 --verify 2 --top 3 \
    --no-progress | tee plan.txt
grep -q "^cluster 8xh100-nvlink" plan.txt

step "jaxspeed train, 2 steps"
"$JS" train tiny.yaml --cpu-devices 8 --steps 2 --output out --no-progress | tee train.txt
"$VPY" -c 'import json, sys; r = json.loads(open("train.txt").read().splitlines()[-1]); sys.exit(0 if r["step"] == 2 else f"test_wheel: train ended at {r}")'

step "jaxspeed bench: one line, exit 2"
set +e
"$JS" bench throughput 2> bench.err
code=$?
set -e
cat bench.err
[ "$code" = 2 ] && [ "$(wc -l < bench.err)" = 1 ] && grep -q "source checkout" bench.err

step "passed"
