#!/usr/bin/env bash
# The whole nanoeuler pipeline on the bundled Shakespeare, end to end, as executable documentation:
#
#   tokenizer -> prepare (token shards) -> pretrain (small) -> SFT (offline instruction set) -> answers + chat
#
# Everything goes under $OUT (default out/pipeline). Runs offline on a laptop CPU; the step counts below
# are modest (about 40 minutes on one quiet core) - raise PRETRAIN_STEPS / SFT_STEPS for a better model.
#
#   scripts/pipeline.sh                       # default sizes
#   PRETRAIN_STEPS=200 SFT_STEPS=50 scripts/pipeline.sh   # a quick smoke run (minutes; answers are poor)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/pipeline}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-2000}
SFT_STEPS=${SFT_STEPS:-1500}
NANOEULER=${NANOEULER:-.venv/bin/nanoeuler}
[ -x "$NANOEULER" ] || NANOEULER="python -m nanoeuler"
mkdir -p "$OUT"
step() { printf '\n=== %s\n' "$*"; }

step "1. tokenizer: byte-level BPE, 512 tokens, trained on the bundled corpus's training works"
[ -f "$OUT/tokenizer.json" ] || $NANOEULER tokenizer train --vocab-size 512 --out "$OUT/tokenizer.json" --no-progress

step "2. prepare: encode the corpus into uint16 token shards (validation = held-out whole works)"
[ -f "$OUT/data/manifest.json" ] || $NANOEULER prepare --tokenizer "$OUT/tokenizer.json" --out "$OUT/data"

step "3. pretrain the small preset ($PRETRAIN_STEPS steps; resumes if interrupted)"
if [ -f "$OUT/base/trainer.json" ]; then
  $NANOEULER train --out "$OUT/base" --resume --no-progress || true
else
  $NANOEULER train small --data "$OUT/data" --tokenizer "$OUT/tokenizer.json" --out "$OUT/base" \
    --steps "$PRETRAIN_STEPS" --eval-every 250 --no-progress
fi
$NANOEULER sample --ckpt "$OUT/base" --prompt "ROMEO." --temperature 0.8 --top-k 40 --seed 1 --max-new-tokens 60

step "4. supervised fine-tuning on the offline instruction set (loss on the response and </s> only)"
if [ -f "$OUT/sft/trainer.json" ]; then
  $NANOEULER sft --out "$OUT/sft" --resume --no-progress || true
else
  $NANOEULER sft --base "$OUT/base" --data offline --out "$OUT/sft" --steps "$SFT_STEPS" --no-progress
fi

step "5. held-out answers: format (ends with </s>) and task accuracy, base model vs fine-tuned"
$NANOEULER sft-eval --ckpt "$OUT/base" --limit 100 --no-progress
$NANOEULER sft-eval --ckpt "$OUT/sft" --limit 100 --show 5 --no-progress

step "6. a short chat (piped input; run \`$NANOEULER chat --ckpt $OUT/sft\` to talk yourself)"
printf '%s\n' "/temp 0" \
  "What is the first word of this line? Now is the winter of our discontent" \
  "What is the last word of this line? Now is the winter of our discontent" \
  "/tokens" \
  "/reset" \
  "What play is this line from? Friends, Romans, countrymen, lend me your ears;" | $NANOEULER chat --ckpt "$OUT/sft" --max-new-tokens 40
