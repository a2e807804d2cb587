#!/usr/bin/env bash
# Peak host memory of `statecut prune` on the CPU, resident vs layer-streamed, on a sharded
# random-weight Qwen3.5 checkpoint with Qwen3.5-9B's per-layer shapes (hidden 4096, MLP 12288,
# linear attention 16 key heads x 128 / 32 value heads x 128, every 4th layer full attention).
#
#   scripts/stream_memory.sh [WORK_DIR] [LAYERS] [VOCAB]
#
# Needs python3 with torch and transformers >= 5.24, GNU time (/usr/bin/time), and a built
# target/release/statecut. The checkpoint is written once into WORK_DIR (default
# /tmp/statecut-stream-memory) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/statecut-stream-memory}
LAYERS=${2:-6}
VOCAB=${3:-32000}
BIN=${STATECUT:-target/release/statecut}
TOKENIZER_FROM=${TOKENIZER_FROM:-${STATECUT_TEST_DATA:-../shared}/models/qwen3_5}
CALIB=${CALIB:-${STATECUT_TEST_DATA:-../shared}/data/calib/wiki.jsonl}
MODEL="$WORK/qwen3_5_9b_shapes_${LAYERS}l"
mkdir -p "$WORK"

if [ ! -f "$MODEL/config.json" ]; then
  python3 - "$MODEL" "$LAYERS" "$VOCAB" "$TOKENIZER_FROM" <<'EOF'
import os, shutil, sys
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

out, layers, vocab, tok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
# Built in bf16 directly: a float32 model first would need twice the memory.
torch.set_default_dtype(torch.bfloat16)
cfg = Qwen3_5TextConfig(
    hidden_size=4096, num_hidden_layers=layers, intermediate_size=12288, vocab_size=vocab,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
model = Qwen3_5ForCausalLM(cfg)
model.save_pretrained(out, max_shard_size="1GB")
for f in os.listdir(tok):
    if f.startswith("tokenizer") or f == "special_tokens_map.json":
        shutil.copy(os.path.join(tok, f), out)
print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {out}")
EOF
fi
echo "checkpoint: $(du -sh "$MODEL" | cut -f1) in $(ls "$MODEL"/*.safetensors | wc -l) shards"

run() {
  local name=$1; shift
  rm -rf "$WORK/out-$name"
  /usr/bin/time -v "$BIN" prune -m "$MODEL" --dtype bf16 --method drrqr --ratio 0.5 --calib "$CALIB" \
    --nsamples 2 --seqlen 64 --rows 512 -o "$WORK/out-$name" -q "$@" 2> "$WORK/time-$name.txt" > /dev/null
  local kb
  kb=$(grep "Maximum resident set size" "$WORK/time-$name.txt" | awk '{print $NF}')
  local wall
  wall=$(grep "Elapsed (wall clock)" "$WORK/time-$name.txt" | awk '{print $NF}')
  printf "%-10s peak RSS %6.2f GiB  wall %s  report: %s\n" "$name" "$(echo "$kb / 1048576" | bc -l)" "$wall" \
    "$(python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['memory']; print(m)" "$WORK/out-$name/statecut_report.json")"
}
run resident
run streamed --offload
python3 - "$WORK" <<'EOF'
import json, sys
r = [json.load(open(f"{sys.argv[1]}/out-{n}/statecut_report.json")) for n in ("resident", "streamed")]
kept = [[h["kept"] for l in x["layers"] for h in l["heads"]] for x in r]
print("same kept channels:", kept[0] == kept[1])
EOF
rm -rf "$WORK/out-resident" "$WORK/out-streamed"
