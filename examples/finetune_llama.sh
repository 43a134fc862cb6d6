#!/usr/bin/env bash
# Continue training a Llama model, every step in order, on this machine:
#   tokenizer -> tokenize -> import-hf -> train (checkpoint.load_from) -> sample -> export.
#
# These machines cannot download weights, so step 3 writes a small *random* Llama in the
# Hugging Face format (config.json + model.safetensors) to stand in for a real one; with a real
# folder (e.g. a downloaded Llama-3.2-1B), skip step 3 and point HF_MODEL at it. The corpus is
# the Python standard library's source files.
#
#   examples/finetune_llama.sh                    # 30 steps on 8 emulated CPU devices
#   STEPS=2 FILES=40 WORK=/tmp/ft examples/finetune_llama.sh   # what the tests run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORK=${WORK:-runs/finetune_llama}
STEPS=${STEPS:-30}     # train steps
FILES=${FILES:-400}    # standard-library files in the corpus
VOCAB=${VOCAB:-512}    # BPE vocabulary = the model's vocab_size
HF_MODEL=${HF_MODEL:-$WORK/hf-random}
js() { "$PY" -m jaxspeed.cli "$@"; }
mkdir -p "$WORK"

echo "== 1. a byte-level BPE tokenizer, trained on local text"
CORPUS=$WORK/corpus
"$PY" - "$CORPUS" "$FILES" <<'EOF'
import shutil, sys, sysconfig
from pathlib import Path
out, count = Path(sys.argv[1]), int(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
for src in sources:
    shutil.copyfile(src, out / (src.stem + ".txt"))
print(f"{len(sources)} files in {out}")
EOF
js tokenizer train "$CORPUS" --vocab-size "$VOCAB" --out "$WORK/tokenizer"

echo "== 2. tokenize the corpus once (documents joined by EOS)"
INFO=$(js tokenize "$CORPUS" --tokenizer "$WORK/tokenizer" --out "$WORK/tokens.npy" --no-progress)
echo "$INFO"
EOS=$("$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["eos_id"])' "$INFO")

if [ "$HF_MODEL" = "$WORK/hf-random" ]; then
  echo "== 3. a small random Llama in the Hugging Face format (stands in for a download)"
  "$PY" - "$HF_MODEL" "$VOCAB" <<'EOF'
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import save_file
out, vocab = Path(sys.argv[1]), int(sys.argv[2])
hidden, layers, heads, kv_heads, ffn = 64, 2, 4, 2, 128
head_dim = hidden // heads
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
    "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
    "head_dim": head_dim, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "torch_dtype": "float32",
}
rng = np.random.default_rng(0)
w = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)
tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
           "model.norm.weight": np.ones(hidden, np.float32)}
for i in range(layers):
    p = f"model.layers.{i}."
    tensors |= {
        p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
        p + "mlp.down_proj.weight": w(hidden, ffn),
        p + "input_layernorm.weight": np.ones(hidden, np.float32),
        p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
    }
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps(config, indent=2))
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
print(f"wrote {out}")
EOF
fi

echo "== 4. import the Hugging Face folder as a jaxspeed checkpoint"
rm -rf "$WORK/imported"
js import-hf "$HF_MODEL" --out "$WORK/imported"

echo "== 5. continue training it (ZeRO-3 on 8 emulated devices, packed documents)"
"$PY" - "$WORK" "$STEPS" "$EOS" <<'EOF'
import json, sys
from pathlib import Path
work, steps, eos = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = json.loads((work / "imported" / "jaxspeed_params.json").read_text())["model"]
model = {k: v for k, v in model.items() if v is not None}
config = {
    "mesh": {"data": -1}, "train_micro_batch_size_per_device": 1,
    "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-3, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosine",
                  "params": {"warmup_num_steps": 5, "total_num_steps": max(steps, 6)}},
    "model": {**model, "max_seq_len": 128},
    "data": {"source": "tokens", "files": [str(work / "tokens.npy")], "seq_len": 128,
             "packing": True, "eos_id": eos, "tokenizer": str(work / "tokenizer")},
    "checkpoint": {"load_from": str(work / "imported")},
    "logging": {"every_n_steps": 1, "sample_every_n_steps": steps, "sample_tokens": 16},
    "steps": steps,
}
(work / "finetune.json").write_text(json.dumps(config, indent=2))
EOF
rm -rf "$WORK/run"
js train "$WORK/finetune.json" --cpu-devices 8 --output "$WORK/run" --no-progress

echo "== 6. sample from the trained checkpoint (key/value cache)"
js sample "$WORK/run/checkpoints" --prompt "def " --tokenizer "$WORK/tokenizer" \
  --max-new-tokens 24 --temperature 0.8 --top-p 0.95 --seed 0 --cpu-devices 8

echo "== 7. export it for transformers (AutoModelForCausalLM.from_pretrained)"
rm -rf "$WORK/hf-out"
js export "$WORK/run/checkpoints" --format hf --out "$WORK/hf-out"
ls "$WORK/hf-out"
