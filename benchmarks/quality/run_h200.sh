#!/usr/bin/env bash
# The two GPU runs of the quality lab, from the repository root on the H200 (each < 10 minutes).
#   step train:    corpus + tokenizer + training (budget below) + NVFP4 export -> $OUT/checkpoint.tar.part-*
#   step evaluate: every configuration against the committed checkpoint -> $OUT/quality.json, $OUT/traces
# The machine gets the tree without .git: pass the commit as TIERSTORE_COMMIT for the provenance.
set -euo pipefail
step="${1:?usage: run_h200.sh train|evaluate}"
out="${OUT:?set OUT to the folder that comes back}"
case "$step" in
  train)
    python3 -m benchmarks.quality.train --preset h200 --out /tmp/quality-run --budget-s "${BUDGET_S:-470}"
    python3 -m benchmarks.quality.export --run /tmp/quality-run --out /tmp/quality-checkpoint --shards 4
    cp /tmp/quality-run/training.json "$out/training.json"
    # What comes back is at most 8 files of 16 MiB: one tar in 15 MiB parts (cat parts | tar -x).
    tar -C /tmp -cf - quality-checkpoint | split -b 15M - "$out/checkpoint.tar.part-"
    ;;
  evaluate)
    python3 -m benchmarks.quality.evaluate --checkpoint benchmarks/quality/checkpoint \
      --out "$out/quality.json" --trace-dir "$out/traces"
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
