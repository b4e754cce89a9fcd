#!/usr/bin/env bash
# The H200 measurements of main, in device calls of under 10 minutes each (one step per call; each step's
# comment below says what it measures; the last ones run are those of 2026-11-30's tenth session: passgather,
# passgather2, mend12, closing12, mend12b, gatherclock, passgather3, and the eleventh's: pair, pair2, pair3, pair4, pair5, pair6, pair7, pairclock2, closing13, and the twelfth's: choice, choice2, closing14, closing14b, closing14c, fp4pair2, and the thirteenth's: closing15, stagewake, closing15b, closing15c, blocks15, final15, and the fourteenth's: unread16, pairclock16, pairprof16, pairprof16b, pairprof16c, plans16, closing16, final16, closing16b, and the fifteenth's: closing17, closing18, final17, recent17, recent17b, and the sixteenth's: closing19, final19, final19b, and the seventeenth's: copies20, spares20, grid20, closing20, recorded20, and the eighteenth's: nomiss21, first21, first21b, choice21, choice21b, and the nineteenth's: head22, skip22, skip22b, skip22c; steps that compare against an older tree need
# its tarball in .baseline carried too (hostpath, hostpath2, qwen3ab, located*, closing11, planvariant); staged /
# stagedx's code was reverted: run them from a5beae6 / 973424c; stage_pass_log's was removed after closing15c, whose
# steps closing15b / closing15c are in h200_session.sh at d518448 / c7e9d20: run them from there; the readers' pieces
# were reverted after pieces28, which is in h200_session.sh at 14a916b: run it from there).
# Run from the repository root on the GPU machine:
#   TIERSTORE_COMMIT=<sha of the tree, taken on the dev machine> bash benchmarks/h200_session.sh kernels
#   TIERSTORE_COMMIT=<sha> bash benchmarks/h200_session.sh runtime      (carry .whl for liburing)
#   TIERSTORE_COMMIT=<sha> bash benchmarks/h200_session.sh runtime2     (carry .whl for liburing)
# Each step writes one archive, $OUT/<step>.tar.gz (the device returns at most 8 files), and prints
# a summary. Every stage has its own time limit, so one that hangs or fails leaves the rest to run;
# its log says what happened. The device's copy of .git can be stale, so the JSON files' provenance
# `commit` is overwritten with $TIERSTORE_COMMIT (the original value is kept as `commit_seen`), except
# under $work/baseline/, where the runs of an older tree write (their --commit names that tree).
set -uo pipefail
step="${1:?usage: h200_session.sh kernels|runtime|runtime2|kernels2|runtime3|final|signal|layers|cuda|closing|adopted|last|verify|recorded|resume|matrix|presets|idle|next|fp4multi|fp4early|btrule|qwen3none|fp4tune|closing3|fp4pdl|closing4|resume2|hostpath|hostpath2|threads|closing5|qwen3ab|repeat5|halftiles|halftiles2|gather|halftiles3|auto|autoab|closing6|stages|stages2|mad|mad2|widerule|closing7|fp4mad|routecost|route2|closing8|replay8|pairorder|closing9|fp4pair|mend10|timeline|timeline2|timeline3|timeline4|hostcut|closing10|events11|hostcut2|located|located2|located3|syncwake|closing11|planvariant|pinning|passgather|passgather2|mend12|closing12|mend12b|gatherclock|passgather3|pair|pair2|pair3|pair4|pair5|pair6|pair7|pairclock2|closing13|choice|choice2|closing14|closing14b|closing14c|fp4pair2|closing15|stagewake|blocks15|final15|unread16|pairclock16|pairprof16|pairprof16b|pairprof16c|plans16|closing16|final16|closing16b|closing17|closing18|final17|recent17|recent17b|closing19|final19|final19b|copies20|spares20|grid20|closing20|recorded20|nomiss21|first21|first21b|choice21|choice21b|head22|skip22|skip22b|skip22c|mend29|next29|bus30|stage30|stage30b|stage30c|stage30d|policy31|policy31b|policy31c|reads32|reads32b|profile32|next33|next33b}"
out="${OUT:?set OUT to the folder that comes back}"
commit="${TIERSTORE_COMMIT:?set TIERSTORE_COMMIT to the commit of the tree (git rev-parse HEAD on the dev machine)}"
work="$out/$step"
mkdir -p "$work"
export PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $work/NAME.log, record the status
  local name="$1" limit="$2"
  shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$work/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status after $((SECONDS - started)) s (limit $limit s)" | tee -a "$work/summary.txt"
}

runtime_gpu_tests() {  # runtime_gpu_tests LIMIT: the GPU tests of the runtime's pool, layer waits, early fetch, cuda_w2
  stage tests "$1" python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_pool_copies.py \
    tests/test_runtime_layer_waits.py tests/test_runtime_early_fetch.py tests/test_runtime_cuda_w2.py \
    tests/test_runtime_located_fetch.py tests/test_runtime_fetch_split.py -m gpu -q
}

ds_recorded_orders() {  # ds-v2-lite on the recorded trace at 50 / 25 / 10 %, the default config against stream_arena=0
  # in one process, the default run first, then the compared one first (twenty-third session; limit 140 s each)
  local order first
  for order in after first; do
    first=()
    [ "$order" = first ] && first=(--compare-first)
    stage "replay-$step-$order" 140 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite \
      --layers 8 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first --trace-top-k trace \
      --compare-config stream_arena=0 ${first[@]+"${first[@]}"} --commit "$commit" \
      --out "$work/replay_ds-v2-lite_${step}-recorded-$order.json"
  done
}

stage_arena_cells() {  # stage_arena_cells LIMIT LIMIT LIMIT LIMIT: issue #5's arena cells (ds-v2-lite synthetic and
  # recorded, qwen3-30b-a3b synthetic and recorded; 4 GiB preloaded, bf16) at the default against stream_stage=0 in
  # one process (twenty-seventh session)
  stage replay-syn-ds "$1" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
    --compare-config stream_stage=0 --commit "$commit" --out "$work/replay_ds-v2-lite_synthetic_$step.json"
  stage replay-rec-ds "$2" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 240 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
    --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first \
    --trace-top-k trace --compare-config stream_stage=0 --commit "$commit" \
    --out "$work/replay_ds-v2-lite_recorded_$step.json"
  stage replay-syn-qwen3 "$3" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
    --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
    --compare-config stream_stage=0 --commit "$commit" --out "$work/replay_qwen3-30b-a3b_synthetic_$step.json"
  stage replay-rec-qwen3 "$4" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
    --steps 240 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
    --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers tile \
    --trace-top-k trace --compare-config stream_stage=0 --commit "$commit" \
    --out "$work/replay_qwen3-30b-a3b_recorded_$step.json"
}

stage30_checks_and_cells() {  # stage30c / stage30d: the stream builds' GPU tests, the kernels alone, the main job,
  # then the arena cells (limits 90 + 60 + 70 + 90 + 90 + 90 + 100 s)
  stage tests 90 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_cuda_w2.py -m gpu -q \
    -k "stream or sass"
  stage stream-kernels 60 python3 benchmarks/stream_kernels.py --presets ds-v2-lite,qwen3-30b-a3b --streamed 0,1,4 \
    --rounds 3 --commit "$commit" --json "$work/stream-kernels.json"
  stage generate-quality 70 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
    --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
  stage_arena_cells 90 90 90 100
}

policy_cells() {  # policy_cells ARENA LIMIT LIMIT LIMIT LIMIT: issue #5's cells at 50 / 25 / 10 % with the arena ARENA
  # (GiB; 4 preloaded, or 0), the default pool policy (lru) against freq-dense in one process (twenty-ninth session):
  # ds-v2-lite synthetic and recorded, qwen3-30b-a3b synthetic and recorded (layers tiled), bf16
  local arena="$1" name
  name=$([ "$arena" = 0 ] && echo none || echo arena)
  stage "replay-syn-ds-$name" "$2" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb "$arena" --arena-preload --dtype bfloat16 \
    --compare-config policy=freq-dense --commit "$commit" --out "$work/replay_ds-v2-lite_synthetic-${name}_$step.json"
  stage "replay-rec-ds-$name" "$3" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb "$arena" --arena-preload --dtype bfloat16 \
    --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first \
    --trace-top-k trace --compare-config policy=freq-dense --commit "$commit" \
    --out "$work/replay_ds-v2-lite_recorded-${name}_$step.json"
  stage "replay-syn-qwen3-$name" "$4" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
    --layers 16 --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb "$arena" --arena-preload \
    --dtype bfloat16 --compare-config policy=freq-dense --commit "$commit" \
    --out "$work/replay_qwen3-30b-a3b_synthetic-${name}_$step.json"
  stage "replay-rec-qwen3-$name" "$5" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
    --layers 16 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb "$arena" --arena-preload \
    --dtype bfloat16 --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers tile \
    --trace-top-k trace --compare-config policy=freq-dense --commit "$commit" \
    --out "$work/replay_qwen3-30b-a3b_recorded-${name}_$step.json"
}

recorded_none_cells() {  # recorded_none_cells LIMIT LIMIT: issue #5's recorded-trace cells at 50 / 25 / 10 % without
  # an arena at the default config (ds-v2-lite, qwen3-30b-a3b with layers tiled; bf16), one tiered run each (thirtieth
  # session: with the floor at the steps' own batch sizes)
  stage replay-rec-ds-none "$1" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 0 --dtype bfloat16 --no-synthetic \
    --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first --trace-top-k trace \
    --commit "$commit" --out "$work/replay_ds-v2-lite_recorded-none_$step.json"
  stage replay-rec-qwen3-none "$2" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
    --layers 16 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 0 --dtype bfloat16 --no-synthetic \
    --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers tile --trace-top-k trace \
    --commit "$commit" --out "$work/replay_qwen3-30b-a3b_recorded-none_$step.json"
}

none_profiles() {  # where a step's host time goes without an arena (benchmarks/step_host_profile.py --arena-gb 0),
  # recorded trace: ds-v2-lite at 25 / 50 %, qwen3-30b-a3b at 10 % (layers tiled); limits 100 + 100 + 120 s (thirtieth
  # session)
  local cov
  for cov in 0.25 0.5; do
    stage "profile-ds-$cov" 100 python3 benchmarks/step_host_profile.py --preset ds-v2-lite --layers 8 --coverage "$cov" \
      --arena-gb 0 --recorded benchmarks/traces/generate-quality-checkpoint.npz --commit "$commit" \
      --json "$work/host-none-ds-v2-lite-$cov.json"
  done
  stage profile-qwen3-0.1 120 python3 benchmarks/step_host_profile.py --preset qwen3-30b-a3b --layers 16 --coverage 0.1 \
    --arena-gb 0 --recorded benchmarks/traces/generate-quality-checkpoint.npz --trace-layers tile --commit "$commit" \
    --json "$work/host-none-qwen3-30b-a3b-0.1.json"
}

compare_rounds() {  # compare_rounds NAME LIMIT CONFIG ROUNDS COVERAGES [alternate|interleave|same [STEPS]]: replay.py
  # --compare-config CONFIG on both presets, ROUNDS rounds, each cell's default and compared runs in one process (the
  # default first; with "alternate", the compared config first in the even rounds: --compare-first; with "interleave",
  # the runtimes taking turns step by step: --interleave, since the fourteenth session the two resident runs too, so
  # the floor's resident step is interleaved as well); STEPS steps of which 20 warm-up (220 unless given)
  local name="$1" limit="$2" config="$3" rounds="$4" coverages="$5" order="${6:-}" steps="${7:-220}" round cell first
  for round in $(seq "$rounds"); do
    first=()
    [ "$order" = alternate ] && [ $((round % 2)) = 0 ] && first=(--compare-first)
    [ "$order" = interleave ] && first=(--interleave)
    for cell in "ds-v2-lite 8" "qwen3-30b-a3b 16"; do
      set -- $cell
      stage "replay-$name-$1-$round" "$limit" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" \
        --steps "$steps" --warmup 20 --coverages "$coverages" --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config "$config" ${first[@]+"${first[@]}"} --commit "$commit" --out "$work/replay_$1_${name}_$round.json"
    done
  done
}

replay_matrix() {  # replay_matrix NAME LIMIT PRESET LAYERS OUT: benchmarks/replay.py as replay8 ran it (synthetic
  # trace, 220 steps of which 20 warm-up, 100 / 50 / 25 / 10 %, 4 GiB arena preloaded, bf16)
  stage "$1" "$2" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$3" --layers "$4" --steps 220 --warmup 20 \
    --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 --commit "$commit" --out "$5"
}

matrix_cells() {  # matrix_cells DS_ARENAS [ARGS...]: issue #5's cells at 100 / 50 / 25 / 10 %, bf16, default config:
  # ds-v2-lite (8 layers) synthetic (with ARGS) and recorded over the arenas DS_ARENAS (GiB, e.g. 4,0; 4 preloaded),
  # then qwen3-30b-a3b (16 layers) synthetic with the 4 GiB arena; limits 230 + 160 + 150 s
  local arenas="$1"
  shift
  stage replay-syn-ds 230 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb "$arenas" --arena-preload --dtype bfloat16 \
    "$@" --commit "$commit" --out "$work/replay_ds-v2-lite_synthetic_$step.json"
  stage replay-rec-ds 160 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
    --steps 240 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb "$arenas" --arena-preload --dtype bfloat16 \
    --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first \
    --trace-top-k trace --commit "$commit" --out "$work/replay_ds-v2-lite_recorded_$step.json"
  stage replay-syn-qwen3 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
    --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
    --commit "$commit" --out "$work/replay_qwen3-30b-a3b_synthetic_$step.json"
}

old_replay() {  # old_replay NAME LIMIT PRESET LAYERS OUT SHA: replay_matrix's run of the old tree unpacked in /tmp/old
  stage "$1" "$2" env PYTHONPATH=/tmp/old bash -c "cd /tmp/old && python3 benchmarks/replay.py --pack-dir /tmp/rp \
    --presets $3 --layers $4 --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload \
    --dtype bfloat16 --commit $6 --out $5"
}

old_timeline() {  # old_timeline NAME LIMIT PRESET LAYERS COVERAGE OUT SHA: the event clock over the old tree in /tmp/old
  stage "$1" "$2" env PYTHONPATH=/tmp/old bash -c "cd /tmp/old && python3 benchmarks/miss_step_timeline.py \
    --preset $3 --layers $4 --coverage $5 --no-profiler --commit $7 --json $6"
}

timeline_ab() {  # timeline_ab SHA: the event clock (miss_step_timeline.py --no-profiler) over the old tree SHA unpacked in
  # /tmp/old and this one, 3 rounds in the orders old new / new old / old new, at ds-v2-lite 8 layers 50 % and
  # qwen3-30b-a3b 16 layers 25 %; stage limit 60 s each
  local sha_old="$1" round order tree cell
  for round in 1 2 3; do
    order="old new"; [ "$round" = 2 ] && order="new old"
    for tree in $order; do
      for cell in "ds-v2-lite 8 0.5" "qwen3-30b-a3b 16 0.25"; do
        set -- $cell
        if [ "$tree" = old ]; then
          old_timeline "timeline-old-$round-$1-$3" 60 "$1" "$2" "$3" "$work/baseline/timeline-old-$round-$1-$3.json" "$sha_old"
        else
          stage "timeline-new-$round-$1-$3" 60 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" \
            --coverage "$3" --no-profiler --commit "$commit" --json "$work/timeline-new-$round-$1-$3.json"
        fi
      done
    done
  done
}

main_job_both_pools() {  # main_job_both_pools LIMIT: the main job on the quality checkpoint, `tierstore generate
  # --verify-resident` of 48 tokens at a 25 % pool and at a full pool (stages generate-quality, generate-quality-full)
  local frac name
  for frac in 0.25 1.0; do
    name=generate-quality; [ "$frac" = 1.0 ] && name=generate-quality-full
    stage "$name" "$1" tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac "$frac" --verify-resident
  done
}

pair_compare() {  # pair_compare NAME LIMIT CONFIG PRESET LAYERS COVERAGES STEPS [BASE]: replay.py, the runtime with
  # --config BASE (default pass_pair_choice=always: every step likely to miss launched as a pair) against
  # --compare-config CONFIG, interleaved step by step with the resident runs; STEPS steps of which 20 warm-up
  stage "replay-$1-$4" "$2" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$4" --layers "$5" \
    --steps "$7" --warmup 20 --coverages "$6" --arena-gb 4 --arena-preload --dtype bfloat16 \
    --config "${8:-pass_pair_choice=always}" --compare-config "$3" --interleave --commit "$commit" \
    --out "$work/replay_$4_$1.json"
}

recorded_compare() {  # recorded_compare NAME CONFIG [BASE]: replay.py on the trace recorded by `tierstore generate`,
  # both presets (ds-v2-lite 8 layers, qwen3-30b-a3b 16 layers tiled) at 50 / 25 / 10 %, the default (or --config BASE)
  # against --compare-config CONFIG, interleaved, 220 steady steps; stages replay-NAME-recorded-PRESET, limits 75 + 95 s
  local cell base=()
  [ -n "${3:-}" ] && base=(--config "$3")
  for cell in "ds-v2-lite 8 first 75" "qwen3-30b-a3b 16 tile 95"; do
    set -- "$1" "$2" "${3:-}" $cell
    stage "replay-$1-recorded-$4" "$7" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$4" --layers "$5" \
      --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 --no-synthetic \
      --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers "$6" --trace-top-k trace \
      ${base[@]+"${base[@]}"} --compare-config "$2" --interleave --commit "$commit" \
      --out "$work/replay_$4_$1_recorded.json"
  done
}

replay_segment_stages() {  # replay_segment_stages NAME: what this torch has for conditional graph nodes; the GPU tests
  # of the pair (the conditional segments alone and in the runtime among them; stopping at the first failure), the
  # first pass, the choice and the layer waits; the main job at a 25 % pool (its default: segments of 4 at skip22*'s
  # commits); then pass_pair_replay_segment=4 against 0 on the recorded trace (both presets, 50 / 25 / 10 %, 220
  # steady steps) and on the synthetic one (both presets, 50 / 25 / 10 %, 300 steady steps), interleaved. Stage
  # limits 60 + 150 + 45 + 75 + 95 + 90 + 60 s.
  stage conditional 60 python3 -c "import logging, torch; logging.basicConfig(level=logging.INFO); \
from tierstore.runtime import replay_if as r; \
print(torch.__version__, torch.version.cuda, 'torch IF nodes:', r._torch_if_nodes(), 'thread pool routing:', \
r._thread_pool_routing(), 'IF nodes ready:', r.prepare_if_nodes(torch.device('cuda')))"
  stage tests 150 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_first_pass.py \
    tests/test_runtime_pair_choice.py tests/test_runtime_layer_waits.py -m gpu -q -x
  stage generate-quality 45 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
    --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
  recorded_compare "$1" pass_pair_replay_segment=0 pass_pair_replay_segment=4
  pair_compare "$1" 90 pass_pair_replay_segment=0 qwen3-30b-a3b 16 0.5,0.25,0.1 320 pass_pair_replay_segment=4
  pair_compare "$1" 60 pass_pair_replay_segment=0 ds-v2-lite 8 0.5,0.25,0.1 320 pass_pair_replay_segment=4
}

fetch_ab() {  # fetch_ab NAME LIMIT ARGS...: benchmarks/fetch_overhead.py on CUDA, the old tree e8b7b7f (unpacked from
  # the carried .baseline/e8b7b7f.tar.gz: the device's .git lacks recent commits) against this one, 300 steps per worker
  local name="$1" limit="$2"
  shift 2
  mkdir -p /tmp/baseline/e8b7b7f && tar -xzf .baseline/e8b7b7f.tar.gz -C /tmp/baseline/e8b7b7f
  stage "$name" "$limit" python3 benchmarks/fetch_overhead.py --device cuda --baseline e8b7b7f \
    --baseline-tree /tmp/baseline/e8b7b7f --steps 300 --commit "$commit" "$@"
}

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/install.log" 2>&1 \
  || { echo "editable install failed: see install.log" | tee -a "$work/summary.txt"; }
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >>"$work/install.log" 2>&1
  export PYTHONPATH=/tmp/site
fi

case "$step" in
  kernels)
    stage kernel-tests 240 python3 -m pytest tests/test_kernels_moe.py tests/test_kernels_gpu.py -q
    stage kernels 300 python3 benchmarks/moe_kernels.py --tokens 1,8,32 --config 64,8 --commit "$commit" \
      --json "$work/kernels-deepseek-v3.json"
    ;;
  runtime)
    stage runtime-tests 110 python3 -m pytest tests/test_runtime_gpu.py tests/test_fp4_gpu.py -q -x
    stage replay-readback 130 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.25 --arena-gb 4 --commit "$commit" --out "$work/replay_readback.json"
    stage replay-warm 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.25 --arena-gb 4 --arena-preload --commit "$commit" \
      --out "$work/replay_warm.json"
    stage gate-cost 130 python3 benchmarks/gate_cost.py --presets ds-v2-lite --layers 8 --steps 60 --warmup 20 \
      --fp4-fractions 0.1,0.25,0.5,1 --gate-fraction 0.25 --fire-every 4 --repetitions 6 --commit "$commit" \
      --out "$work/gate_cost_held.json"
    stage io-fetch 90 python3 benchmarks/io_fetch.py --dir /tmp/iobh --rows 64 --repeats 5 --depths 1,8,32 \
      --out "$work/io_fetch.json"
    ;;
  runtime2)  # ~8.5 min of stage limits; estimates in docs/runtime-history.md ("runtime2: commands and sizing")
    stage replay-qwen3 180 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.25,1 --arena-gb 4 --commit "$commit" --out "$work/replay_qwen3.json"
    stage replay-recorded 170 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 400 --warmup 20 --coverages 0.1,0.25,0.5 --arena-gb 4 --no-synthetic \
      --trace benchmarks/results/quality-traces/quality-fp4_checkpoint.npz --trace-layers first --trace-top-k trace \
      --commit "$commit" --out "$work/replay_recorded.json"
    # the quality lab's trained checkpoint through the runtime on CUDA (graphs): tiered == resident,
    # and the gate's fired steps with an all-FP4 context == the all-FP4 run
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    stage generate-quality-gate 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --fp4-pool-frac 0.5 --gate --gate-tau 0.6 --verify-fp4 \
      --gate-dump "$work/gate_fires.jsonl"
    ;;
  kernels2)  # v8 with its scale bias, v9 down candidates, the CUDA C++ gate_up experiment (~5 min expected)
    stage kernel-tests 120 python3 -m pytest tests/test_kernels_moe.py tests/test_kernels_gpu.py -q \
      -k "down_ or bytes_0_and_1 or fp4 or plain_and_ptx or graph"
    stage cuda-w2-tests 100 python3 -m pytest tests/test_cuda_w2.py -q
    stage kernels 200 python3 benchmarks/moe_kernels.py --tokens 1,8,32 --config 64,8 --commit "$commit" \
      --skip w2_fused_plain,w2_gate_up_plain,w2_fused_mma16,dequant_grouped_mm --json "$work/kernels-deepseek-v3-v9.json"
    stage cuda-w2 140 python3 benchmarks/cuda_w2.py --commit "$commit" --json "$work/cuda_w2.json"
    ;;
  runtime3)  # copies overlapping the step, the gate's captured signal (~3.5 min expected)
    stage runtime-tests 150 python3 -m pytest tests/test_runtime_fetch_split.py tests/test_runtime_gpu.py \
      tests/test_fp4_gpu.py tests/test_gate_signal.py -m gpu -q
    stage replay-overlap 130 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.25 --arena-gb 4 --arena-preload --commit "$commit" \
      --out "$work/replay_overlap.json"
    stage gate-cost 130 python3 benchmarks/gate_cost.py --presets ds-v2-lite --layers 8 --steps 60 --warmup 20 \
      --fp4-fractions 0.1,0.25,0.5,1 --gate-fraction 0.25 --fire-every 4 --repetitions 6 --commit "$commit" \
      --out "$work/gate_cost_signal.json"
    stage replay-qwen3 110 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.25,1 --arena-gb 4 --commit "$commit" --out "$work/replay_qwen3.json"
    stage generate-quality 50 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  final)  # v10 combine-in-down (since removed), the FP4 step split after its fixes, bf16 runs (~5 min expected)
    stage runtime-tests 80 python3 -m pytest tests/test_fp4_gpu.py tests/test_runtime_gpu.py \
      tests/test_runtime_fetch_split.py -m gpu -q
    stage kernel-tests 80 python3 -m pytest tests/test_kernels_moe.py tests/test_kernels_gpu.py -q \
      -k "down_launch"
    stage kernels 120 python3 benchmarks/moe_kernels.py --tokens 1,8,32 --config 64,8 --commit "$commit" \
      --skip w2_gate_up,w2_down,w2_fused_plain,w2_gate_up_plain,w2_fused_mma16,dequant_grouped_mm,fp4_gate_up,w2_fused_down64w8,fp4_fused_down64w8 \
      --json "$work/kernels-deepseek-v3-v10.json"
    stage gate-split 70 python3 benchmarks/gate_cost.py --split --presets ds-v2-lite --layers 8 --steps 60 --warmup 10 \
      --rounds 4 --split-dtypes float32,bfloat16 --commit "$commit" --out "$work/gate_split.json"
    stage gate-cost-bf16 60 python3 benchmarks/gate_cost.py --presets ds-v2-lite --layers 8 --steps 60 --warmup 20 \
      --fp4-fractions 0.1,0.25,0.5,1 --gate-fraction 0.25 --fire-every 4 --repetitions 8 --dtype bfloat16 \
      --commit "$commit" --out "$work/gate_cost_bf16.json"
    stage replay-bf16 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 --commit "$commit" \
      --out "$work/replay_bf16.json"
    stage generate-quality-gate 50 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --fp4-pool-frac 0.5 --gate --gate-tau 0.6 --verify-fp4
    ;;
  signal)  # the gate's Triton confidence kernel: GPU tests, armed cost in bf16, gated generate (~2 min expected)
    stage signal-tests 100 python3 -m pytest tests/test_gate_signal.py tests/test_confidence_kernel.py -q
    stage gate-cost-bf16 120 python3 benchmarks/gate_cost.py --presets ds-v2-lite --layers 8 --steps 60 --warmup 20 \
      --fp4-fractions 0.25 --gate-fraction 0.25 --fire-every 4 --repetitions 8 --dtype bfloat16 --commit "$commit" \
      --out "$work/gate_cost_signal_kernel.json"
    stage generate-quality-gate 60 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --fp4-pool-frac 0.5 --gate --gate-tau 0.6 --verify-fp4
    ;;
  layers)  # per-layer copy waits (config layer_waits) on and off, the CUDA W2 knob in the runtime (~6 min expected)
    stage runtime-tests 200 python3 -m pytest tests/test_runtime_layer_waits.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_gpu.py tests/test_runtime_fetch_split.py tests/test_runtime_cuda_w2.py tests/test_fp4_gpu.py \
      -m gpu -q
    for round in 1 2; do
      stage "replay-waits-$round" 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
        --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-layer-waits --commit "$commit" --out "$work/replay_waits_$round.json"
    done
    stage generate-quality 50 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  cuda)  # the multi-token CUDA W2 stages, the CUDA FP4 stages, the miss step's host profile (~7 min expected)
    stage cuda-w2-multi-tests 110 python3 -m pytest tests/test_cuda_w2_multi.py tests/test_cuda_w2.py -m gpu -q
    stage cuda-w2-multi 140 python3 benchmarks/cuda_w2.py --commit "$commit" \
      --variants cuda_mma_ahead2,cuda_gate_up_multi,cuda_down,cuda_down_multi,cuda_whole,cuda_whole_multi \
      --json "$work/cuda-w2-multi.json"
    stage cuda-fp4-tests 90 python3 -m pytest tests/test_cuda_fp4.py -m gpu -q
    stage cuda-fp4 130 python3 benchmarks/cuda_fp4.py --commit "$commit" --json "$work/cuda-fp4.json"
    stage miss-step-profile 50 python3 benchmarks/miss_step_profile.py --coverage 0.25 --steps 200
    stage pool-copies-tests 40 python3 -m pytest tests/test_runtime_pool_copies.py -m gpu -q
    ;;
  closing)  # the session's changes on the GPU: runtime + kernel tests, gate_up multi v2, replay with layer waits (~6 min)
    stage runtime-tests 130 python3 -m pytest tests/test_runtime_layer_waits.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_gpu.py tests/test_runtime_fetch_split.py tests/test_runtime_cuda_w2.py tests/test_fp4_gpu.py \
      -m gpu -q
    stage kernel-tests 100 python3 -m pytest tests/test_cuda_w2_multi.py tests/test_cuda_fp4.py -m gpu -q
    stage cuda-w2-v2 100 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 8,32 \
      --variants cuda_mma_ahead2,cuda_gate_up_multi,cuda_gate_up_multi_e,cuda_gate_up_multi_s4,cuda_gate_up_multi_w4s3,cuda_gate_up_multi_w4s3e,cuda_whole,cuda_whole_multi,cuda_whole_multi_s4e,cuda_whole_multi_w4s3e \
      --json "$work/cuda-w2-v2.json"
    stage replay-waits-1 120 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-layer-waits --commit "$commit" --out "$work/replay_waits_1.json"
    stage replay-waits-2 90 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-layer-waits --commit "$commit" --out "$work/replay_waits_2.json"
    stage generate-quality 50 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  adopted)  # the adopted multi gate_up (W2MoeCuda default) on the GPU, the W2 whole op at T = 1 / 8 / 32 (~3 min)
    stage tests 120 python3 -m pytest tests/test_cuda_w2_multi.py tests/test_runtime_cuda_w2.py -m gpu -q
    stage cuda-w2 120 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8,32 \
      --variants cuda_mma_ahead2,cuda_down,cuda_whole,cuda_whole_multi,cuda_whole_multi_s4e \
      --json "$work/cuda-w2-adopted.json"
    ;;
  last)  # single-token W2 latency cuts (v3) at T = 1 / 8; two copy streams in the replay (~4 min)
    stage tests 110 python3 -m pytest tests/test_cuda_w2.py tests/test_runtime_layer_waits.py \
      tests/test_runtime_pool_copies.py -m gpu -q
    stage cuda-w2-v3 60 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8 \
      --variants cuda_mma_ahead2,cuda_mma_ahead2_e,cuda_mma_ahead2_g,cuda_mma_ahead2_eg,cuda_down,cuda_down_e,cuda_down_g,cuda_down_eg,cuda_whole,cuda_whole_eg,cuda_whole_er,cuda_whole_egp \
      --json "$work/cuda-w2-v3.json"
    stage replay-streams 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config copy_streams=2 --commit "$commit" --out "$work/replay_streams.json"
    ;;
  verify)  # the adopted v3 single-token kernels as W2MoeCuda's default: kernel, FP4 and runtime GPU tests, the whole op at
    # T = 1 / 8 / 32, two replay rounds at 25% with one and two copy streams (~4 min)
    stage tests 110 python3 -m pytest tests/test_cuda_w2.py tests/test_cuda_fp4.py tests/test_runtime_cuda_w2.py -m gpu -q
    stage cuda-w2 50 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8,32 \
      --variants cuda_mma_ahead2,cuda_down,cuda_whole,cuda_whole_egp,cuda_whole_multi,cuda_whole_multi_s4e \
      --json "$work/cuda-w2-verify.json"
    for round in 1 2; do
      stage "replay-streams-$round" 60 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
        --steps 220 --warmup 20 --coverages 0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config copy_streams=2 --commit "$commit" --out "$work/replay_streams_$round.json"
    done
    ;;
  recorded)  # the trace recorded by `tierstore generate` (benchmarks/traces/README.md): ds-v2-lite (8 layers) and
    # qwen3-30b-a3b (16 layers, trace layers tiled) at 10 / 25 / 50 / 100%, 4 GiB arena preloaded and no arena
    # (stage limits 240 + 240 s; not yet run)
    stage replay-generated-ds 240 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 240 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4,0 --arena-preload --dtype bfloat16 --no-synthetic \
      --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first --trace-top-k trace \
      --commit "$commit" --out "$work/replay_generated_ds.json"
    stage replay-generated-qwen3 240 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 240 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4,0 --arena-preload --dtype bfloat16 --no-synthetic \
      --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers tile --trace-top-k trace \
      --commit "$commit" --out "$work/replay_generated_qwen3.json"
    ;;
  resume)  # first call of the next session: the GPU tests of the CPU-only changes after ab6ed8d (c33c4d1, f70be4b,
    # 8407196, db42f67, f321e34: policy batch hooks, victim walk, arena key checks, engine.step, prefill victims; and
    # the early_fetch option with its GPU tests in test_runtime_early_fetch.py), the full preset x T kernel test (not
    # re-run in full since the v9 down launch), the quality checkpoint tiered == resident, and one replay round of
    # closing's replay-waits-1 (1.25x-of-floor target with the current code), side by side with early_fetch on (the
    # compared run replaces closing's layer_waits-off run, which 18 earlier rounds measured).
    # Stage limits 100 + 110 + 40 + 140 + 170 = 560 s. Estimates (not measured for this tree) from the summary.txt of
    # earlier runs of the same commands: runtime-tests ~50 s (closing 48 s, layers 55 / 47 s, same file set);
    # cuda-tests ~60 s (cuda step: test_cuda_w2_multi + test_cuda_w2 42 s, test_cuda_fp4 16 s); generate-quality
    # ~22 s (closing 21 s, layers 22 s); replay-waits ~80-100 s (closing 77 s, layers 101 / 88 s); kernel-presets-test
    # at most ~160 s (the kernels step ran test_kernels_moe.py + all of test_kernels_gpu.py in 166 s; this is part of
    # that), last so that a run past its limit costs nothing else
    stage runtime-tests 100 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_fetch_split.py tests/test_fp4_gpu.py \
      tests/test_runtime_cuda_w2.py tests/test_runtime_early_fetch.py -m gpu -q
    stage cuda-tests 110 python3 -m pytest tests/test_cuda_w2.py tests/test_cuda_w2_multi.py tests/test_cuda_fp4.py \
      -m gpu -q
    stage generate-quality 40 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    stage replay-waits 140 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config early_fetch=1 --commit "$commit" --out "$work/replay_early_fetch.json"
    stage kernel-presets-test 170 python3 -m pytest tests/test_kernels_gpu.py -m gpu -q -k test_presets_match_reference
    ;;
  matrix)  # issue #5's benchmark matrix cells never measured with the current code (docs/runtime-history.md, "What of the
    # issue's benchmark matrix was measured"): synthetic trace, bf16, 220 steps (20 cold): ds-v2-lite (8 layers) with
    # no arena at 10 / 25 / 50 / 100%; qwen3-30b-a3b (16 layers) with the 4 GiB arena preloaded at 10 / 50%, then
    # 25 / 100% (never measured preloaded either). Stage limits 200 + 170 + 150 = 520 s. Estimates, not measured:
    # replay-none-ds ~105 s (bf18a97's no-arena rows, replay_h200_steady.json: 20.5 s of timed steps over the four
    # coverages at 60 steps, x 220/60 = ~75 s, plus ~30 s of imports, compiles and pack build as sized in
    # docs/runtime-history.md "runtime2: commands and sizing"); each qwen3 stage ~70-90 s (runtime2 / runtime3's replay-qwen3,
    # the same preset, layers and steps at 25 / 100% with a cold arena: 66 s / 65 s, plus the preloads of 2.5 GiB)
    stage replay-none-ds 200 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 0 --dtype bfloat16 --commit "$commit" \
      --out "$work/replay_none_ds.json"
    stage replay-preloaded-qwen3 170 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
      --layers 16 --steps 220 --warmup 20 --coverages 0.1,0.5 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_preloaded_qwen3.json"
    stage replay-preloaded-qwen3-b 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
      --layers 16 --steps 220 --warmup 20 --coverages 0.25,1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_preloaded_qwen3_b.json"
    ;;
  presets)  # issue #9 s. 3: the Triton kernels (benchmarks/moe_kernels.py: W2 / FP4 fused, stages, bf16 _grouped_mm, the
    # streaming ceilings) on the DESIGN.md presets never measured with the current kernels, T = 1 / 8 / 32 / 64 / 512,
    # and deepseek-v3 at T = 64 / 512; then the CUDA C++ W2 whole op (benchmarks/cuda_w2.py, verify's variants) on the
    # presets whose shapes it accepts (hidden and inter multiples of 512: olmoe-1b-7b, mixtral-8x7b, ds4-flash,
    # kimi-k2; not ds-v2-lite (inter 1408) or qwen3-30b-a3b (768)) at T = 1 / 8 / 32. Variants not timed here: the
    # plain-Triton decode twins, dequantize-then-_grouped_mm and the down64w8 candidate (as in the kernels2 / final
    # runs). Stage limits 60 + 6 x 60 + 4 x 35 = 560 s. Estimates, not measured: ~25-40 s per moe_kernels.py run (the
    # deepseek-v3 runs at T = 1 / 8 / 32 took 38 s (kernels), 26 s (kernels2), 24 s (final), mostly start-up and
    # checks; T = 64 / 512 were never timed with these kernels); ~13 s per cuda_w2.py run (verify: 13 s, the same
    # variants at T = 1 / 8 / 32 on deepseek-v3). Each JSON is rewritten after every stage, so a run stopped at its
    # limit keeps the T values it finished.
    skip=w2_fused_plain,w2_gate_up_plain,dequant_grouped_mm,w2_fused_down64w8,fp4_fused_down64w8
    stage kernels-deepseek-v3 60 python3 benchmarks/moe_kernels.py --preset deepseek-v3 --tokens 64,512 --config 64,8 \
      --skip "$skip" --commit "$commit" --json "$work/kernels-deepseek-v3-t64-512.json"
    for preset in olmoe-1b-7b ds-v2-lite qwen3-30b-a3b mixtral-8x7b ds4-flash kimi-k2; do
      stage "kernels-$preset" 60 python3 benchmarks/moe_kernels.py --preset "$preset" --tokens 1,8,32,64,512 --config 64,8 \
        --skip "$skip" --commit "$commit" --json "$work/kernels-$preset.json"
    done
    for preset in olmoe-1b-7b mixtral-8x7b ds4-flash kimi-k2; do
      stage "cuda-w2-$preset" 35 python3 benchmarks/cuda_w2.py --preset "$preset" --tokens 1,8,32 \
        --variants cuda_mma_ahead2,cuda_down,cuda_whole,cuda_whole_egp,cuda_whole_multi,cuda_whole_multi_s4e \
        --commit "$commit" --json "$work/cuda-w2-$preset.json"
    done
    ;;
  inflight|ahead)  # early_fetch side by side with the default: inflight at 7cb5f06 (two installs in flight, 1673507 /
    # 9207eba: the fetch after the pass-log read no longer waits for the copies fetched during the pass; resume had
    # measured early_fetch at 0.84-1.02x the default before) and ahead at 6506a1c (evict-ahead, 9b810c6, reverted
    # since). GPU tests of the pool and early fetch; ds-v2-lite synthetic (two runs), the generate-recorded trace and
    # qwen3-30b-a3b, all with the 4 GiB arena preloaded (the change helps arena hits only); generate --early-fetch on
    # the quality checkpoint, tiered == resident; inflight also re-ran kimi-k2 T = 512 after the stream ceiling's fix.
    # Stage limits 100 + 130 + 70 + 90 + 90 + 40 (+ 45) = 520 (565) s; measured: inflight 45, 91, 32, 45, 59, 17, 32 s;
    # ahead 38, 76, 34, 54, 61, 19 s (summary.txt of each).
    stage tests 100 python3 -m pytest tests/test_runtime_pool_copies.py tests/test_runtime_early_fetch.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_gpu.py tests/test_runtime_fetch_split.py -m gpu -q
    stage "replay-$step-1" 130 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config early_fetch=1 --commit "$commit" --out "$work/replay_${step}_1.json"
    stage "replay-$step-2" 70 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config early_fetch=1 --commit "$commit" --out "$work/replay_${step}_2.json"
    stage "replay-$step-recorded" 90 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 --no-synthetic \
      --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first --trace-top-k trace \
      --compare-config early_fetch=1 --commit "$commit" --out "$work/replay_${step}_recorded.json"
    stage "replay-$step-qwen3" 90 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config early_fetch=1 --commit "$commit" --out "$work/replay_${step}_qwen3.json"
    stage generate-early 40 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --early-fetch --verify-resident
    if [ "$step" = inflight ]; then
      stage kernels-kimi-k2-t512 45 python3 benchmarks/moe_kernels.py --preset kimi-k2 --tokens 512 --config 64,8 \
        --skip w2_fused_plain,w2_gate_up_plain,dequant_grouped_mm,w2_fused_down64w8,fp4_fused_down64w8 \
        --commit "$commit" --json "$work/kernels-kimi-k2-t512.json"
    fi
    ;;
  idle)  # the early_fetch variant left on main after evict-ahead's revert (idle-gated during-pass installs, the
    # fetch after the pass-log read not waiting for them; the code of 1673507, never measured on its own): its GPU
    # tests and one side-by-side round at 50 / 25% (~2 min; the device time left in the session was 257 s)
    stage tests 60 python3 -m pytest tests/test_runtime_pool_copies.py tests/test_runtime_early_fetch.py -m gpu -q
    stage replay-idle 70 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config early_fetch=1 --commit "$commit" --out "$work/replay_idle.json"
    ;;
  next)  # 2026-11-30 (third session): the GPU tests changed after 8f33af4 (prefill_chunk passed to the compared runs in
    # test_runtime_gpu / test_runtime_cuda_w2; the cuda_w2 rule to 8 pairs per expert, 50c0de3); then the CUDA
    # multi-token whole op at T = 64 / 512 (never timed there; the Triton tensor-core path it would replace runs at
    # 0.30x - 0.78x bf16 at these T, kernels-*-54fb697.json) on every preset whose shapes it accepts, bf16 in the same
    # run; then generate --verify-resident. Stage limits 150 + 5 x 45 + 40 = 415 s. Estimates, not measured: tests
    # ~60-90 s; cuda_w2 ~10-20 s per preset (presets: 5-7 s at T = 1 / 8 / 32; T = 512 adds the Triton BT = 1 op).
    stage tests 150 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_cuda_w2.py tests/test_fp4_gpu.py \
      tests/test_runtime_pool_copies.py tests/test_runtime_early_fetch.py tests/test_runtime_layer_waits.py -m gpu -q
    for preset in deepseek-v3 kimi-k2 ds4-flash mixtral-8x7b olmoe-1b-7b; do
      stage "cuda-w2-$preset-t64-512" 45 python3 benchmarks/cuda_w2.py --preset "$preset" --tokens 64,512 \
        --variants cuda_whole_multi,cuda_whole_multi_s4e --commit "$commit" --json "$work/cuda-w2-$preset-t64-512.json"
    done
    stage generate-quality 40 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  fp4multi)  # 2026-11-30 (third session): the multi-token FP4 kernels (fp4_moe_multi.cu, TierMoeCuda on block_tokens 16)
    # against the single-token ones, Triton and bf16 at deepseek-v3 T = 1 / 8 / 32 / 64 (the FP4 >= 3x target is
    # missed at T = 32: 2.25x, cuda-fp4-deepseek-v3.json); the GPU tests of the new kernels, of the W2 multi-token
    # kernels (their pair staging now goes through bf16_mma.cuh's build_columns) and of the runtime's cuda_w2 rule
    # (64 pairs per expert, the 8-column gate_up above 4); then the W2 whole op at T = 8 / 32 beside the presets
    # run's numbers (the refactor must not slow it). Stage limits 150 + 200 + 45 = 395 s. Estimates, not measured:
    # tests ~90 s (cuda step: test_cuda_w2_multi + test_cuda_w2 42 s, test_cuda_fp4 16 s), cuda_fp4 ~60-120 s.
    stage tests 150 python3 -m pytest tests/test_cuda_fp4.py tests/test_cuda_w2_multi.py tests/test_runtime_cuda_w2.py \
      -m gpu -q
    stage cuda-fp4 200 python3 benchmarks/cuda_fp4.py --tokens 1,8,32,64 --commit "$commit" \
      --json "$work/cuda-fp4-multi-deepseek-v3.json"
    stage cuda-w2 45 python3 benchmarks/cuda_w2.py --preset deepseek-v3 --tokens 8,32 \
      --variants cuda_whole_egp,cuda_whole_multi_s4e --commit "$commit" --json "$work/cuda-w2-deepseek-v3-t8-32.json"
    ;;
  fp4early)  # the multi-token FP4 kernels with FP4_EARLY (2 round trips in the prologue) beside the default at
    # deepseek-v3 T = 32 (where fp4multi measured 3.02x / 2.91x bf16 in its two rounds), 64 and 512 (never run: the
    # runtime rule's upper limit with an FP4 pool). Stage limits 90 + 240 = 330 s. Estimates, not measured: tests
    # ~40 s, cuda_fp4 ~90 s (fp4multi: 29 s for T = 1 / 8 / 32 / 64).
    stage tests 90 python3 -m pytest tests/test_cuda_fp4.py -m gpu -q
    stage cuda-fp4 240 python3 benchmarks/cuda_fp4.py --tokens 32,64,512 --commit "$commit" \
      --json "$work/cuda-fp4-early-deepseek-v3.json"
    ;;
  btrule)  # moe_mm's default block size: one pair per program up to 4 pairs per expert (was 1), from the Triton rows
    # of the cuda_w2 / cuda_fp4 runs against moe_kernels.py's default rows of 54fb697 (separate runs). Here side by side
    # in one run per preset at the batch sizes the change moves: `w2_fused` / `fp4_fused` (the new default, one pair
    # per program) against `*_fused_mma16` (the tensor-core blocks, the old default), and past the new switch
    # (deepseek-v3 T = 129 would be; T = 256 is) the new default's blocks against `*_fused_bt1`. Then the GPU tests
    # of the kernels and of this session's CUDA changes not yet run on a GPU (W2 gate_up width, FP4 8-column gate_up
    # in TierMoeCuda, the runtime's cuda_w2 rule). Stage limits 7 x 45 + 170 = 485 s. Estimates, not measured:
    # ~25-40 s per moe_kernels.py run (presets: 25-40 s for five T), tests ~120 s.
    skip=w2_fused_plain,w2_gate_up_plain,dequant_grouped_mm,w2_fused_down64w8,fp4_fused_down64w8,w2_gate_up,fp4_gate_up
    for case in deepseek-v3:64,128,256 kimi-k2:64 ds4-flash:64 qwen3-30b-a3b:32,64 ds-v2-lite:16,32,42 \
                mixtral-8x7b:8,16 olmoe-1b-7b:16,32; do
      preset="${case%%:*}"
      stage "kernels-$preset" 45 python3 benchmarks/moe_kernels.py --preset "$preset" --tokens "${case#*:}" --config 64,8 \
        --skip "$skip" --commit "$commit" --json "$work/kernels-btrule-$preset.json"
    done
    stage tests 170 python3 -m pytest tests/test_kernels_moe.py tests/test_kernels_gpu.py tests/test_cuda_w2_multi.py \
      tests/test_cuda_fp4.py tests/test_runtime_cuda_w2.py -m gpu -q
    ;;
  qwen3none)  # the last 4 cells of issue #5's benchmark matrix: qwen3-30b-a3b, synthetic trace, no arena, bf16, at 10 /
    # 25% and 50 / 100% (matrix's replay-none-ds for ds-v2-lite). Stage limits 2 x 230 = 460 s. Estimate, not
    # measured: ~80-160 s per stage (replay-none-ds: 80 s for four coverages of ds-v2-lite at 8 layers; qwen3 has
    # 16 layers of smaller experts, 1.15x the missed bytes per step at equal coverage, plus its pack build).
    # The JSON is rewritten after every coverage, so a stage stopped at its limit keeps the ones it finished.
    stage replay-none-qwen3 230 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.1,0.25 --arena-gb 0 --dtype bfloat16 --commit "$commit" \
      --out "$work/replay_none_qwen3.json"
    stage replay-none-qwen3-b 230 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.5,1 --arena-gb 0 --dtype bfloat16 --commit "$commit" \
      --out "$work/replay_none_qwen3_b.json"
    ;;
  fp4tune)  # the multi-token FP4 op at deepseek-v3 T = 32, where it sits on the 3x line (3.01x - 3.02x / 2.91x - 2.92x):
    # four launch variants beside the default (benchmarks/cuda_fp4.py MULTI: down at FP4_AHEAD 1 with 4 blocks per SM,
    # gate_up at 4 warps x 3 columns, at 2 columns, at the largest carveout), the run twice (two processes, two
    # rounds each). Stage limits 2 x 100 = 200 s. Estimate, not measured: ~40 s per run (fp4multi:
    # 29 s for four T).
    stage cuda-fp4-a 100 python3 benchmarks/cuda_fp4.py --tokens 32 --commit "$commit" \
      --json "$work/cuda-fp4-tune-a-deepseek-v3.json"
    stage cuda-fp4-b 100 python3 benchmarks/cuda_fp4.py --tokens 32 --commit "$commit" \
      --json "$work/cuda-fp4-tune-b-deepseek-v3.json"
    ;;
  closing3)  # the GPU tests of every file this session's last changes touched, at the session's last code commit:
    # the multi-token FP4 down at FP4_AHEAD 1 in TierMoeCuda, its launch bounds by FP4_AHEAD, W2MoeCuda's 8-column
    # gate_up, moe_mm's default block size, the runtime's cuda_w2 rule. Stage limit 240 s. Estimate, not measured:
    # ~150 s (btrule's tests: 100 s without test_cuda_w2, ~40 s).
    stage tests 240 python3 -m pytest tests/test_kernels_moe.py tests/test_kernels_gpu.py tests/test_cuda_w2.py \
      tests/test_cuda_w2_multi.py tests/test_cuda_fp4.py tests/test_runtime_cuda_w2.py tests/test_runtime_gpu.py -m gpu -q
    ;;
  fp4pdl)  # FP4_PDL on the multi-token FP4 stages (the down a programmatic dependent of the gate_up) beside the adopted
    # launches (`_d1`), all-FP4 and mixed layers, deepseek-v3 T = 32, two processes; the GPU tests of test_cuda_fp4
    # first (the PDL launches byte-identical to the default, eager and in a graph). Stage limits 100 + 90 + 60 = 250 s.
    # Estimates, not measured: tests ~45 s (fp4early: 35 s), ~12-45 s per cuda_fp4 run (fp4tune: 42 s, then 12 s).
    stage tests 100 python3 -m pytest tests/test_cuda_fp4.py -m gpu -q
    stage cuda-fp4-a 90 python3 benchmarks/cuda_fp4.py --tokens 32 --commit "$commit" \
      --json "$work/cuda-fp4-pdl-a-deepseek-v3.json"
    stage cuda-fp4-b 60 python3 benchmarks/cuda_fp4.py --tokens 32 --commit "$commit" \
      --json "$work/cuda-fp4-pdl-b-deepseek-v3.json"
    ;;
  closing4)  # the GPU tests after FP4_PDL became TierMoeCuda's default (2a27908): the FP4 stages and the runtime with
    # cuda_w2. Stage limit 150 s. Estimate, not measured: ~70 s (fp4pdl's test_cuda_fp4: 41 s).
    stage tests 150 python3 -m pytest tests/test_cuda_fp4.py tests/test_runtime_cuda_w2.py -m gpu -q
    ;;
  resume2)  # 2026-11-30 (fourth session), first call: the GPU tests of every file changed since closing4 (11679d4):
    # the review mends (load_coherent in bf16_mma.cuh, w2_multi.route_args, w2_down.launch_dependent,
    # Kernel.prefer_carveout, w2_moe.wide_gate), the runtime's prefill token chunks on CUDA (new GPU test, Triton and
    # cuda_w2); then the row-copy microbenchmark (benchmarks/h2d_batch.py: per-row driver copies as DevicePool issues
    # them vs cuMemcpyBatchAsync vs one contiguous copy) at the 25% and 50% ds-v2-lite fetch sizes. Stage limits
    # 300 + 60 + 60 s. Estimates, not measured: tests ~150 s (closing3: 134 s), ~15 s per copy run.
    stage tests 300 python3 -m pytest tests/test_kernels_moe.py tests/test_kernels_gpu.py tests/test_cuda_w2.py \
      tests/test_cuda_w2_multi.py tests/test_cuda_fp4.py tests/test_runtime_cuda_w2.py tests/test_runtime_gpu.py -m gpu -q
    stage h2d-24 60 python3 benchmarks/h2d_batch.py --rows 24 --commit "$commit" --json "$work/h2d-batch-24.json"
    stage h2d-12 60 python3 benchmarks/h2d_batch.py --rows 12 --commit "$commit" --json "$work/h2d-batch-12.json"
    ;;
  hostpath)  # the miss path's host latency cut (ids instead of key tuples for the protected set, arena rows not
    # re-checked, one batched arena hit lookup, the install's stream lookup by index and a reused event): the GPU
    # tests of the runtime files it touches (and the chunk test, one layer now), then benchmarks/fetch_overhead.py
    # on CUDA, old tree (e8b7b7f: carry .baseline, made by `git archive --format=tar.gz -o
    # .baseline/e8b7b7f.tar.gz e8b7b7f tierstore`; the device's .git lacks recent commits) vs new alternating, ds-v2-lite 8 layers,
    # preloaded arena, bf16, graphs: 3 rounds at 25%, 2 at 50%. Stage limits 150 + 200 + 140 s. Measured on the
    # first try (d0241bf, the comparison failed without .baseline): tests 76 s. Estimate, not measured: ~15-20 s
    # per worker process (10 of them).
    runtime_gpu_tests 150
    fetch_ab overhead-25 200 --coverage 0.25 --rounds 3 --out "$work/fetch_overhead_cuda_25.json"
    fetch_ab overhead-50 140 --coverage 0.5 --rounds 2 --out "$work/fetch_overhead_cuda_50.json"
    ;;
  hostpath2)  # the host path after hostpath (c2a6611 / dda35dc): the first layer's rows now go before the table (staged
    # while they are on the bus), the table copy without re-checks. GPU tests of the pool, layer waits, early fetch
    # and runtime; fetch_overhead on CUDA old (e8b7b7f, carried .baseline tar.gz) vs new, 3 rounds at 25% and 3 at 50%;
    # then the replay benchmark's warm ds-v2-lite cells with this code (preloaded 4 GiB arena, bf16, 220 steps, 50 / 25
    # / 10%) for the 1.25x-of-floor target. Stage limits 150 + 120 + 120 + 150 s. Measured at dda35dc: tests 28 s,
    # 3 rounds at 25% 69 s, 2 rounds at 50% 50 s; estimate, not measured: replay ~100 s (resume's replay-waits at two
    # coverages 77-101 s, the 10% cell adds its naive run).
    runtime_gpu_tests 150
    fetch_ab overhead-25 120 --coverage 0.25 --rounds 3 --out "$work/fetch_overhead_cuda_25.json"
    fetch_ab overhead-50 120 --coverage 0.5 --rounds 3 --out "$work/fetch_overhead_cuda_50.json"
    stage replay-warm 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_warm_ds.json"
    ;;
  threads)  # why the replay benchmark's fetch host time at 25% (0.380 ms at 89a6613) is ~1.9x fetch_overhead's in the
    # same call (0.218 ms; arena and install alike): fetch_overhead's workers run torch.set_num_threads(1). The
    # replay's warm 25% / 50% cells twice each way, alternating: default threads, then OMP_NUM_THREADS=1. Stage limits
    # 4 x 60 s. Estimate, not measured: ~35 s each (hostpath2's three coverages took 48 s).
    for round in 1 2; do
      stage replay-default-$round 60 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
        --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --commit "$commit" --out "$work/replay_threads_default_$round.json"
      stage replay-omp1-$round 60 env OMP_NUM_THREADS=1 python3 benchmarks/replay.py --pack-dir /tmp/rp \
        --presets ds-v2-lite --layers 8 --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload \
        --dtype bfloat16 --commit "$commit" --out "$work/replay_threads_omp1_$round.json"
    done
    ;;
  closing5)  # the last host-path cuts (Arena.holds_all, the install's key check by count_nonzero) on the GPU: the runtime
    # GPU tests, the replay's warm ds-v2-lite cells (50 / 25 / 10%) and qwen3-30b-a3b's (16 layers, preloaded 4 GiB
    # arena; last measured at 54fb697) with this code. Stage limits 150 + 100 + 200 s. Measured: tests 49-56 s
    # (hostpath2), ds-v2-lite 48 s (hostpath2); estimate, not measured: qwen3 ~90-120 s (matrix's two-coverage qwen3
    # stages took ~70-90 s).
    runtime_gpu_tests 150
    stage replay-warm-ds 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_warm_ds.json"
    stage replay-warm-qwen3 200 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_warm_qwen3.json"
    ;;
  qwen3ab)  # closing5's qwen3-30b-a3b cells were slower than at 54fb697 at 50 / 25% (fetch host 0.474 / 0.662 ms vs 0.292 /
    # 0.468 ms; 10% alike), a separate call: old (e8b7b7f, carried .baseline tar.gz) vs new (the host-path cuts) side
    # by side on qwen3-30b-a3b, 16 layers, preloaded arena, bf16, graphs: 2 rounds at 50%, 2 at 25%. Stage limits
    # 170 + 170 s. Estimate, not measured: ~25-35 s per worker (8 of them).
    fetch_ab overhead-qwen3-50 170 --preset qwen3-30b-a3b --layers 16 --coverage 0.5 --rounds 2 \
      --out "$work/fetch_overhead_cuda_qwen3_50.json"
    fetch_ab overhead-qwen3-25 170 --preset qwen3-30b-a3b --layers 16 --coverage 0.25 --rounds 2 \
      --out "$work/fetch_overhead_cuda_qwen3_25.json"
    ;;
  repeat5)  # more runs of closing5's warm cells with the final code (the target claims rest on few runs per cell):
    # ds-v2-lite twice, qwen3-30b-a3b once, as closing5. Stage limits 80 + 80 + 110 s. Measured at 595f42a
    # (closing5): 46 s and 76 s.
    for round in 1 2; do
      stage replay-warm-ds-$round 80 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
        --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --commit "$commit" --out "$work/replay_warm_ds_$round.json"
    done
    stage replay-warm-qwen3 110 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_warm_qwen3.json"
    ;;
  halftiles)  # the CUDA down kernels' 16-word tile build (W2_WPS 16: ds-v2-lite inter 1408, qwen3-30b-a3b 768) on the GPU
    # for the first time: its GPU tests with the CUDA W2 / multi / runtime ones; benchmarks/cuda_w2.py on both presets
    # (verify's variants and the multi-token down) at T = 1 / 8 / 32; the replay's warm ds-v2-lite cells with every run
    # on the CUDA kernels (--config cuda_w2=1: resident, tiered, naive), then Triton vs CUDA tiered side by side
    # (--compare-config cuda_w2=1); qwen3-30b-a3b with every run on the CUDA kernels. Stage limits 170 + 2 x 45 + 80 +
    # 80 + 120 = 540 s. Estimates, not measured: tests ~120 s (verify's 110 s limit held test_cuda_w2 + fp4 + runtime),
    # cuda_w2.py ~15-30 s per preset (verify 13 s), replays as repeat5 (46 s, 76 s; the side by side adds a run).
    stage tests 170 python3 -m pytest tests/test_cuda_w2_half_tiles.py tests/test_cuda_w2.py tests/test_cuda_w2_multi.py \
      tests/test_runtime_cuda_w2.py -m gpu -q
    for preset in ds-v2-lite qwen3-30b-a3b; do
      stage "cuda-w2-$preset" 45 python3 benchmarks/cuda_w2.py --preset "$preset" --tokens 1,8,32 \
        --variants cuda_mma_ahead2,cuda_down,cuda_down_multi,cuda_whole,cuda_whole_egp,cuda_whole_multi,cuda_whole_multi_s4e \
        --commit "$commit" --json "$work/cuda-w2-$preset.json"
    done
    stage replay-ds-cuda 80 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --config cuda_w2=1 --commit "$commit" --out "$work/replay_ds_cuda.json"
    stage replay-ds-ab 80 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1.0,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config cuda_w2=1 --commit "$commit" --out "$work/replay_ds_ab.json"
    stage replay-qwen3-cuda 120 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --config cuda_w2=1 --commit "$commit" --out "$work/replay_qwen3_cuda.json"
    ;;
  halftiles2)  # more runs of halftiles' replay with every run on the CUDA kernels (the target claims rest on few runs): ds-v2-lite
    # twice, qwen3-30b-a3b once. Stage limits 90 + 90 + 120 s. Measured at 9cad872 (halftiles): 73 s and 91 s.
    for round in 1 2; do
      stage replay-ds-cuda-$round 90 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
        --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --config cuda_w2=1 --commit "$commit" --out "$work/replay_ds_cuda_$round.json"
    done
    stage replay-qwen3-cuda 120 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --config cuda_w2=1 --commit "$commit" --out "$work/replay_qwen3_cuda.json"
    ;;
  gather)  # the miss path's copies issued per row by the host (cuMemcpyHtoDAsync) against a kernel per layer that reads the
    # pinned rows over the bus (benchmarks/row_gather.cu then; gather_rows in kernels/cuda/pass_gather.cu now): host issue time and device time, 24 and 12 ds-v2-lite rows
    # over 8 layers, 4 / 16 / 64 blocks per row. Stage limits 60 + 60 s; estimate, not measured: ~15 s each (h2d_batch).
    for rows in 24 12; do
      stage "h2d-gather-$rows" 60 python3 benchmarks/h2d_gather.py --rows "$rows" --blocks 4,16,64 --commit "$commit" \
        --json "$work/h2d-gather-$rows.json"
    done
    ;;
  halftiles3)  # the FP4 down kernels' 16-word tile build (FP4_WPS 16) and bf16_mma.cuh's generalised K loop on the GPU:
    # the half-tile, FP4 and runtime cuda_w2 GPU tests; benchmarks/cuda_fp4.py on ds-v2-lite (FP4 and both tiers on
    # 16-word tiles) at T = 1 / 8 / 32; `tierstore replay --cuda-w2` on the recorded trace (the CLI end to end). Stage
    # limits 200 + 150 + 90 s. Estimates, not measured: tests ~120 s (halftiles' 68 s plus test_cuda_fp4's ~41 s),
    # cuda_fp4.py ~60-120 s (22 builds on a cold cache; fp4tune 42 s), the CLI ~40 s.
    stage tests 200 python3 -m pytest tests/test_cuda_w2_half_tiles.py tests/test_cuda_fp4.py \
      tests/test_runtime_cuda_w2.py -m gpu -q
    stage cuda-fp4-ds-v2-lite 150 python3 benchmarks/cuda_fp4.py --preset ds-v2-lite --tokens 1,8,32 \
      --commit "$commit" --json "$work/cuda-fp4-ds-v2-lite.json"
    stage replay-cli 90 python3 -m tierstore replay --trace benchmarks/traces/generate-quality-checkpoint.npz \
      --preset ds-v2-lite --layers 8 --trace-layers tile --gpu-pool-frac 0.25 --arena-gb 4 --pack-dir /tmp/rp \
      --steps 120 --warmup 20 --dtype bfloat16 --arena-preload --cuda-w2 --json "$work/replay_cli.json"
    ;;
  auto)  # config cuda_w2 "auto" (the new default) on the GPU: the runtime GPU tests with default configs (pool, layer
    # waits, early fetch, cuda_w2, the chunked prefill), then `tierstore replay` on the recorded trace in bf16 with the
    # default (auto: its `kernels:` line says which ran) and with --no-cuda-w2 (Triton), one after the other in one call.
    # Stage limits 200 + 60 + 60 s. Estimates, not measured: tests ~100 s (runtime_gpu_tests: 49-56 s, plus
    # test_runtime_gpu's chunk tests), ~25 s per replay (halftiles3's CLI run: 23 s).
    stage tests 200 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_early_fetch.py tests/test_runtime_cuda_w2.py -m gpu -q
    for kernels in auto no-cuda-w2; do
      flag=$([ "$kernels" = auto ] || echo "--no-cuda-w2")
      stage "replay-cli-$kernels" 60 python3 -m tierstore replay --trace benchmarks/traces/generate-quality-checkpoint.npz \
        --preset ds-v2-lite --layers 8 --trace-layers tile --gpu-pool-frac 0.25 --arena-gb 4 --pack-dir /tmp/rp \
        --steps 120 --warmup 20 --dtype bfloat16 --arena-preload $flag --json "$work/replay_cli_$kernels.json"
    done
    ;;
  autoab)  # auto's CUDA kernels against Triton in one process on the recorded trace (the auto step's CLI runs, one after
    # the other, had the tiered step 0.777 vs 0.757 ms with the CUDA run's install host time +88 us): ds-v2-lite 8
    # layers, bf16, 4 GiB arena preloaded, 25% and 100%; base auto with Triton flipped in, then base Triton with auto
    # flipped in (order control). Stage limits 100 + 100 s. Estimate, not measured: ~40-60 s each (replay-ds-ab: 38 s).
    trace=benchmarks/traces/generate-quality-checkpoint.npz
    stage replay-rec-auto-first 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --no-synthetic --trace "$trace" --trace-layers tile --steps 240 --warmup 20 --coverages 0.25,1.0 --arena-gb 4 \
      --arena-preload --dtype bfloat16 --compare-config cuda_w2=0 --commit "$commit" --out "$work/replay_rec_auto_first.json"
    stage replay-rec-triton-first 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --no-synthetic --trace "$trace" --trace-layers tile --steps 240 --warmup 20 --coverages 0.25,1.0 --arena-gb 4 \
      --arena-preload --dtype bfloat16 --config cuda_w2=0 --compare-config cuda_w2=auto --commit "$commit" \
      --out "$work/replay_rec_triton_first.json"
    ;;
  closing6)  # the session's last code on the GPU: every CUDA kernel test (W2 single / multi, the 16-word tiles, FP4: the K
    # loop in bf16_mma.cuh was generalised since their last full run) and the runtime GPU tests with the default config
    # (cuda_w2 auto), then the main job's command on the quality checkpoint (hidden 256: auto keeps Triton) with
    # --verify-resident. Stage limits 300 + 80 s. Estimates, not measured: ~200 s (halftiles 60 s, halftiles3 78 s, auto
    # 73 s, with overlaps), generate ~40 s.
    stage tests 300 python3 -m pytest tests/test_cuda_w2.py tests/test_cuda_w2_multi.py tests/test_cuda_w2_half_tiles.py \
      tests/test_cuda_fp4.py tests/test_runtime_gpu.py tests/test_runtime_pool_copies.py tests/test_runtime_layer_waits.py \
      tests/test_runtime_early_fetch.py tests/test_runtime_cuda_w2.py -m gpu -q
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  stages)  # v4 (cuda-w2-notes.md): the single-token gate_up's tiles staged through shared memory by cp.async
    # (W2_STAGES 3 / 4) against the register ring (ahead 2), alone and in the whole op (egp), DeepSeek-V3 at T = 1 / 8;
    # and benchmarks/w2_access.py, the gate_up's reads alone at depths 1-4 in the row pattern and contiguous. The GPU
    # tests first (staged bytes equal to the ring's). Stage limits 150 + 60 + 200 s. Estimates, not measured: tests
    # ~60 s, the probe ~20 s, cuda_w2.py ~60-90 s (v3's run of 12 variants at T = 1 / 8: ~40 s plus builds).
    stage tests 150 python3 -m pytest tests/test_cuda_w2_stages.py tests/test_cuda_w2.py -m gpu -q -k "staged or v3"
    stage w2-access 60 python3 benchmarks/w2_access.py --ahead 1,2,3,4 --commit "$commit" --json "$work/w2-access.json"
    stage cuda-w2-v4 200 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8 \
      --variants cuda_mma_ahead2,cuda_mma_ahead2_eg,cuda_mma_ahead2_egs3,cuda_mma_ahead2_egs4,cuda_whole,cuda_whole_egp,cuda_whole_egps3,cuda_whole_egps4 \
      --json "$work/cuda-w2-v4-deepseek-v3.json"
    ;;
  stages2)  # stages' probe timed eagerly measured Python's launch rate (~53 us per launch for every variant): now a CUDA
    # graph of the launches; and ncu's view of the T = 1 gate_up (the adopted eg build, the 3-stage one): warp stalls,
    # issue, memory throughput (--clock-control none; ncu may not read counters on this machine's runtime: its log
    # says). Stage limits 60 + 90 + 90 s. Estimates, not measured: probe ~15 s, each ncu run ~20-40 s.
    stage w2-access 60 python3 benchmarks/w2_access.py --ahead 1,2,3,4 --commit "$commit" --json "$work/w2-access.json"
    ncu_flags="--clock-control none --kernel-name w2_gate_up_mma --launch-skip 2 --launch-count 1 --section SpeedOfLight
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy
      --section LaunchStats"
    stage ncu-gate-up-eg 90 ncu $ncu_flags python3 benchmarks/gate_up_once.py --v3
    stage ncu-gate-up-egs3 90 ncu $ncu_flags python3 benchmarks/gate_up_once.py --v3 --stages 3
    ;;
  mad)  # v5 (cuda-w2-notes.md): slot pairs 0..4 decoded by a multiply-add (W2_DECODE_MAD) against the default decode:
    # GPU tests (bytes equal), cuda_w2.py on DeepSeek-V3 at T = 1 / 8 (gate_up, down, whole op) and on ds-v2-lite and
    # qwen3-30b-a3b at T = 1 (the whole op), ncu's pipe and stall view of both T = 1 gate_up builds. Stage limits 150 +
    # 120 + 2 x 90 + 2 x 90 s. Estimates, not measured: tests ~60 s, DeepSeek-V3 ~30 s, each preset ~20 s, ncu ~10 s.
    stage tests 150 python3 -m pytest tests/test_cuda_w2_decode_mad.py -m gpu -q
    stage cuda-w2-v5 120 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8 \
      --variants cuda_mma_ahead2,cuda_mma_ahead2_eg,cuda_mma_ahead2_egm,cuda_down,cuda_down_g,cuda_down_gm,cuda_whole,cuda_whole_egp,cuda_whole_egpm \
      --json "$work/cuda-w2-v5-deepseek-v3.json"
    for preset in ds-v2-lite qwen3-30b-a3b; do
      stage "cuda-w2-v5-$preset" 90 python3 benchmarks/cuda_w2.py --preset "$preset" --commit "$commit" --tokens 1 \
        --variants cuda_whole,cuda_whole_egp,cuda_whole_egpm --json "$work/cuda-w2-v5-$preset.json"
    done
    ncu_flags="--clock-control none --kernel-name w2_gate_up_mma --launch-skip 2 --launch-count 1 --section SpeedOfLight
      --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active"
    stage ncu-gate-up-eg 90 ncu $ncu_flags python3 benchmarks/gate_up_once.py --v3
    stage ncu-gate-up-egmad 90 ncu $ncu_flags python3 benchmarks/gate_up_once.py --v3 --mad
    ;;
  mad2)  # v5 adopted for the single-token kernels (w2_moe.SINGLE); now the multi-token kernels with it (the runtime's
    # T = 8 / 32 on the presets and DeepSeek-V3's T = 32; mixtral-8x7b at T = 32 runs the 8-column gate_up) and the v4
    # stages on top of it at T = 1 / 8 (after v5 the T = 1 gate_up's largest stall is its global loads). GPU tests of
    # v4, v5 and the runtime with cuda_w2 (its default changed). Stage limits 240 + 200 + 3 x 100 s. Estimates, not
    # measured: tests ~120 s, DeepSeek-V3 ~60 s (T = 32 runs the single-token variants too), each preset ~20 s.
    stage tests 240 python3 -m pytest tests/test_cuda_w2_decode_mad.py tests/test_cuda_w2_stages.py \
      tests/test_runtime_cuda_w2.py -m gpu -q
    stage cuda-w2-v5b 200 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8,32 \
      --variants cuda_mma_ahead2,cuda_mma_ahead2_egm,cuda_mma_ahead2_egs3m,cuda_mma_ahead2_egs4m,cuda_whole,cuda_whole_egpm,cuda_whole_egps3m,cuda_whole_egps4m,cuda_whole_multi,cuda_whole_multi_s4e,cuda_whole_multi_s4em \
      --json "$work/cuda-w2-v5b-deepseek-v3.json"
    for preset in ds-v2-lite qwen3-30b-a3b mixtral-8x7b; do
      tokens=$([ "$preset" = mixtral-8x7b ] && echo 32 || echo 8,32)
      stage "cuda-w2-v5b-$preset" 100 python3 benchmarks/cuda_w2.py --preset "$preset" --commit "$commit" \
        --tokens "$tokens" --variants cuda_whole_multi,cuda_whole_multi_s4e,cuda_whole_multi_s4em \
        --json "$work/cuda-w2-v5b-$preset.json"
    done
    ;;
  widerule)  # where the multi-token gate_up's 8-column build (W2MoeCuda's wide gate_up) should take over from the
    # 4-column s4e (WIDE_FROM = 4 pairs per expert today): both with v5's decode at 1.5-3 pairs per expert on three
    # presets (ds-v2-lite T = 16 / 24 / 32, qwen3-30b-a3b T = 32 / 48, deepseek-v3 T = 64 / 80). Stage limits 3 x 100 s.
    # Estimates, not measured: ~10-30 s each.
    for preset in ds-v2-lite qwen3-30b-a3b deepseek-v3; do
      tokens=$(case "$preset" in ds-v2-lite) echo 16,24,32 ;; qwen3-30b-a3b) echo 32,48 ;; *) echo 64,80 ;; esac)
      stage "cuda-w2-wide-$preset" 100 python3 benchmarks/cuda_w2.py --preset "$preset" --commit "$commit" \
        --tokens "$tokens" --variants cuda_whole_multi,cuda_whole_multi_s4em,cuda_whole_multi_m \
        --json "$work/cuda-w2-wide-$preset.json"
    done
    ;;
  closing7)  # the session's last code on the GPU (v5's decode in every W2 kernel by default): every CUDA kernel test and
    # the runtime GPU tests with the default config (cuda_w2 auto), then the main job's command on the quality
    # checkpoint with --verify-resident. Stage limits 420 + 80 s. Estimate, not measured: closing6's 135 tests plus
    # the v4 / v5 files (~60 s), generate ~40 s.
    stage tests 420 python3 -m pytest tests/test_cuda_w2.py tests/test_cuda_w2_multi.py tests/test_cuda_w2_half_tiles.py \
      tests/test_cuda_w2_stages.py tests/test_cuda_w2_decode_mad.py tests/test_cuda_fp4.py tests/test_runtime_gpu.py \
      tests/test_runtime_pool_copies.py tests/test_runtime_layer_waits.py tests/test_runtime_early_fetch.py \
      tests/test_runtime_cuda_w2.py -m gpu -q
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  fp4mad)  # FP4 v2 (cuda-fp4-notes.md): the FP4 decode's right shifts as IMAD.HI (FP4_DECODE_MAD) against the default
    # decode: GPU tests (bytes equal), cuda_fp4.py on DeepSeek-V3 at T = 1 / 8 / 32 in two processes (T = 32 sits on the
    # 3x line), on ds-v2-lite once (16-word FP4 downs), ncu's pipe and stall view of both T = 1 FP4 gate_up builds. Stage
    # limits 200 + 2 x 200 + 120 + 2 x 90 s. Estimates, not measured: tests ~90 s with the builds, each DeepSeek-V3 run
    # ~90 s, ds-v2-lite ~50 s, ncu ~15 s each.
    stage tests 200 python3 -m pytest tests/test_cuda_fp4_decode_mad.py -m gpu -q
    for run in a b; do
      stage "cuda-fp4-mad-$run" 200 python3 benchmarks/cuda_fp4.py --commit "$commit" --tokens 1,8,32 \
        --variants cuda_fp4_gate_up_m,cuda_fp4_down_m,cuda_fp4_whole_m,cuda_tier_mixed_m,cuda_fp4_whole_multi_pdl,cuda_fp4_whole_multi_pdl_m,cuda_tier_mixed_multi_pdl,cuda_tier_mixed_multi_pdl_m \
        --json "$work/cuda-fp4-mad-$run-deepseek-v3.json"
    done
    stage cuda-fp4-mad-ds-v2-lite 120 python3 benchmarks/cuda_fp4.py --preset ds-v2-lite --commit "$commit" \
      --tokens 1,8,32 --variants cuda_fp4_gate_up_m,cuda_fp4_down_m,cuda_fp4_whole_m,cuda_fp4_whole_multi_pdl,cuda_fp4_whole_multi_pdl_m,cuda_tier_mixed_multi_pdl,cuda_tier_mixed_multi_pdl_m \
      --json "$work/cuda-fp4-mad-ds-v2-lite.json"
    ncu_flags="--clock-control none --kernel-name fp4_gate_up_mma --launch-skip 2 --launch-count 1 --section SpeedOfLight
      --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active"
    stage ncu-fp4-gate-up 90 ncu $ncu_flags python3 benchmarks/gate_up_once.py --fp4
    stage ncu-fp4-gate-up-mad 90 ncu $ncu_flags python3 benchmarks/gate_up_once.py --fp4 --mad
    ;;
  routecost)  # the fused op's two weightless launches (moe_route, moe_combine) alone and together against an empty
    # Triton launch, per preset and T (route + combine were 9.5 / 14.2 / 37.9 us of DeepSeek-V3's whole op at T = 1 / 8
    # / 32, never split). Stage limit 200 s. Estimate, not measured: ~60 s.
    stage route-cost 200 python3 benchmarks/route_cost.py --presets deepseek-v3,ds-v2-lite,qwen3-30b-a3b \
      --tokens 1,8,32 --commit "$commit" --json "$work/route-cost.json"
    ;;
  route2)  # the routing kernel's second version (kernel-notes.md, "The routing kernel") on the GPU: its tests against
    # the plain-Python reference on the device, then route_cost.py with every variant beside route_v1 (benchmarks/route_v1.py,
    # removed after this run: run route2 from 4a0c5b4 to repeat the comparison), the usual case
    # (no misses) on three presets and DeepSeek-V3 at prefill sizes, and once with 4 missing experts (the miss log's
    # atomics). Stage limits 120 + 240 + 120 s. Estimates, not measured: tests ~30 s, ~80 s, ~40 s.
    stage tests 120 python3 -m pytest tests/test_route_kernel.py -q
    stage route-cost 240 python3 benchmarks/route_cost.py --presets deepseek-v3,ds-v2-lite,qwen3-30b-a3b \
      --tokens 1,8,32 --commit "$commit" --json "$work/route-cost.json"
    stage route-cost-prefill 120 python3 benchmarks/route_cost.py --presets deepseek-v3 --tokens 64,512 \
      --commit "$commit" --json "$work/route-cost-prefill.json"
    stage route-cost-missing 120 python3 benchmarks/route_cost.py --presets deepseek-v3,ds-v2-lite --tokens 1,32 \
      --missing 4 --commit "$commit" --json "$work/route-cost-missing.json"
    ;;
  closing8)  # the routing kernel's second version (moe_route's default since f705acb) under everything that routes: the
    # kernel, CUDA and runtime GPU tests, the route's tests on the device, the whole ops at the adopted defaults (W2 on
    # DeepSeek-V3 and the runtime's presets, FP4 on DeepSeek-V3), the main job's --verify-resident. Stage limits 300 +
    # 60 + 150 + 2 x 90 + 120 + 80 s. Estimates, not measured: tests ~150 s (closing7's 161 in 120 s), route ~20 s,
    # DeepSeek-V3 ~60 s, presets ~30 s each, FP4 ~40 s, generate ~40 s.
    stage tests 300 python3 -m pytest tests/test_kernels_moe.py tests/test_cuda_w2.py tests/test_cuda_w2_multi.py \
      tests/test_cuda_w2_half_tiles.py tests/test_cuda_w2_decode_mad.py tests/test_cuda_fp4.py \
      tests/test_cuda_fp4_decode_mad.py tests/test_runtime_gpu.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_early_fetch.py tests/test_runtime_cuda_w2.py -m gpu -q
    stage route-tests 60 python3 -m pytest tests/test_route_kernel.py -q
    stage cuda-w2-route2 150 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8,32 \
      --variants cuda_whole,cuda_whole_egpm,cuda_whole_multi,cuda_whole_multi_s4em --json "$work/cuda-w2-route2-deepseek-v3.json"
    for preset in ds-v2-lite qwen3-30b-a3b; do
      stage "cuda-w2-route2-$preset" 90 python3 benchmarks/cuda_w2.py --preset "$preset" --commit "$commit" \
        --tokens 1,8,32 --variants cuda_whole,cuda_whole_egpm,cuda_whole_multi,cuda_whole_multi_s4em \
        --json "$work/cuda-w2-route2-$preset.json"
    done
    stage cuda-fp4-route2 120 python3 benchmarks/cuda_fp4.py --commit "$commit" --tokens 1,8,32 \
      --variants cuda_fp4_whole_multi_pdl,cuda_tier_mixed_multi_pdl --json "$work/cuda-fp4-route2-deepseek-v3.json"
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  replay8)  # the replay benchmark with the routing kernel's second version (every launch of a step routes once per
    # layer): ds-v2-lite (8 layers) and qwen3-30b-a3b (16), synthetic trace, 4 GiB arena preloaded, bf16, the default
    # kernels (auto: CUDA on the H200), as halftiles2 ran them at 9cad872. Stage limits 120 + 150 s. Measured at
    # 9cad872: 73-91 s per ds-v2-lite run.
    stage replay-ds 120 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_ds_route2.json"
    stage replay-qwen3 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_qwen3_route2.json"
    ;;
  pairorder)  # the single-token kernels in pair order with the route beside them (cuda-w2-notes.md "Pair order"):
    # their GPU tests and the tests of every file moe_mm's fork touches, then the whole op on DeepSeek-V3 at T = 1 / 8
    # and on ds-v2-lite / qwen3-30b-a3b at T = 1, `_egpmo` against `_egpm` in one process. Stage limits 300 + 100 +
    # 2 x 70 s. Estimates, not measured: tests ~150 s, DeepSeek-V3 ~25 s, each preset ~15 s.
    stage tests 300 python3 -m pytest tests/test_cuda_w2_pair_order.py tests/test_cuda_w2.py tests/test_kernels_moe.py \
      tests/test_runtime_cuda_w2.py tests/test_runtime_gpu.py -m gpu -q
    stage cuda-w2-pairorder 100 python3 benchmarks/cuda_w2.py --commit "$commit" --tokens 1,8 \
      --variants cuda_whole,cuda_whole_egpm,cuda_whole_egpmo --json "$work/cuda-w2-pairorder-deepseek-v3.json"
    for preset in ds-v2-lite qwen3-30b-a3b; do
      stage "cuda-w2-pairorder-$preset" 70 python3 benchmarks/cuda_w2.py --preset "$preset" --commit "$commit" \
        --tokens 1 --variants cuda_whole,cuda_whole_egpm,cuda_whole_egpmo --json "$work/cuda-w2-pairorder-$preset.json"
    done
    ;;
  closing9)  # pair order adopted (w2_moe.SINGLE, moe_mm routes beside the single-token kernels): every kernel, CUDA and
    # runtime GPU test (the runtime's captured steps now fork the route), the route's tests, the main job's
    # --verify-resident, and the replay benchmark on ds-v2-lite as replay8 ran it. Stage limits 330 + 60 + 80 + 120 s.
    # Estimates, not measured: tests ~200 s (closing8: 167 in 161 s, plus pairorder's), ~20 s, ~25 s, ~70 s.
    stage tests 330 python3 -m pytest tests/test_kernels_moe.py tests/test_cuda_w2.py tests/test_cuda_w2_multi.py \
      tests/test_cuda_w2_half_tiles.py tests/test_cuda_w2_decode_mad.py tests/test_cuda_w2_stages.py \
      tests/test_cuda_w2_pair_order.py tests/test_cuda_fp4.py tests/test_cuda_fp4_decode_mad.py tests/test_runtime_gpu.py \
      tests/test_runtime_pool_copies.py tests/test_runtime_layer_waits.py tests/test_runtime_early_fetch.py \
      tests/test_runtime_cuda_w2.py -m gpu -q
    stage route-tests 60 python3 -m pytest tests/test_route_kernel.py -q
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    stage replay-ds 120 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --commit "$commit" --out "$work/replay_ds_pairorder.json"
    ;;
  fp4pair)  # the single-token FP4 kernels in pair order (cuda-fp4-notes.md "Pair order for the single-token FP4
    # kernels"), made TierMoeCuda's default in the same commit: the FP4 and runtime GPU tests, the all-FP4 and mixed ops
    # at T = 1 against both tiers in route order, the main job's --verify-resident. Stage limits 200 + 60 + 60 s (the
    # session's device time left: ~6 min). Estimates, not measured: tests ~150 s, ~15 s, ~25 s.
    stage tests 200 python3 -m pytest tests/test_cuda_fp4_pair_order.py tests/test_cuda_fp4.py \
      tests/test_runtime_cuda_w2.py -m gpu -q
    stage cuda-fp4-pair 60 python3 benchmarks/cuda_fp4.py --commit "$commit" --tokens 1 \
      --variants cuda_fp4_whole,cuda_fp4_whole_ro,cuda_tier_mixed,cuda_tier_mixed_ro --json "$work/cuda-fp4-pair-deepseek-v3.json"
    stage generate-quality 60 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  mend10)  # the review mends after fp4pair (one grid rule, moe_mm's ids, route_blocks) on the GPU: both pair-order test
    # files and the route's tests. Stage limits 150 + 40 s (the session's device time left: ~4 min).
    stage tests 150 python3 -m pytest tests/test_cuda_w2_pair_order.py tests/test_cuda_fp4_pair_order.py -m gpu -q
    stage route-tests 40 python3 -m pytest tests/test_route_kernel.py -q
    ;;
  timeline)  # the review mends' GPU tests (mend10), then where a tiered step's wall time goes on the device
    # (benchmarks/miss_step_timeline.py: torch.profiler's device timestamps cut into launch, first pass, host until the
    # first row copy, copies, replay tail, end): ds-v2-lite 8 layers at 50 / 25 / 100 %, qwen3-30b-a3b 16 layers at 25 %.
    stage tests 150 python3 -m pytest tests/test_cuda_w2_pair_order.py tests/test_cuda_fp4_pair_order.py -m gpu -q
    stage route-tests 40 python3 -m pytest tests/test_route_kernel.py -q
    for cell in "ds-v2-lite 8 0.5" "ds-v2-lite 8 0.25" "ds-v2-lite 8 1.0" "qwen3-30b-a3b 16 0.25"; do
      set -- $cell
      stage "timeline-$1-$3" 100 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" --coverage "$3" \
        --commit "$commit" --json "$work/timeline-$1-$3.json"
    done
    ;;
  timeline2)  # timeline again with the event clock (no profiler) beside the profiler's: ds-v2-lite 8 layers at 50 / 25
    # / 10 / 100 %, qwen3-30b-a3b 16 layers at 50 / 25 %
    for cell in "ds-v2-lite 8 0.5" "ds-v2-lite 8 0.25" "ds-v2-lite 8 0.1" "ds-v2-lite 8 1.0" "qwen3-30b-a3b 16 0.5" \
                "qwen3-30b-a3b 16 0.25"; do
      set -- $cell
      stage "timeline-$1-$3" 100 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" --coverage "$3" \
        --commit "$commit" --json "$work/timeline-$1-$3.json"
    done
    ;;
  timeline3)  # timeline2's event clock with host marks inside the reads (sync returned) and the install (first row
    # copy issued): ds-v2-lite 8 layers at 50 / 25 / 100 %, qwen3-30b-a3b 16 layers at 25 %
    for cell in "ds-v2-lite 8 0.5" "ds-v2-lite 8 0.25" "ds-v2-lite 8 1.0" "qwen3-30b-a3b 16 0.25"; do
      set -- $cell
      stage "timeline-$1-$3" 100 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" --coverage "$3" \
        --commit "$commit" --json "$work/timeline-$1-$3.json"
    done
    ;;
  timeline4)  # the event clock with entry marks along the fetch path (missing, victims, arena lookups, install,
    # staging buffers, copies by layer, map), no profiler: ds-v2-lite 8 layers at 50 / 25 %, qwen3-30b-a3b 16 layers at 25 %
    for cell in "ds-v2-lite 8 0.5" "ds-v2-lite 8 0.25" "qwen3-30b-a3b 16 0.25"; do
      set -- $cell
      stage "timeline-$1-$3" 100 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" --coverage "$3" \
        --no-profiler --commit "$commit" --json "$work/timeline-$1-$3.json"
    done
    ;;
  hostcut)  # the fetch path's host cuts (one arena lookup, an all-hit fast path, no second key check, the pass log's
    # stream by index) on the GPU: the runtime's GPU tests, then miss_step_timeline.py --no-profiler, the tree before
    # them (15ce2d3, carried as .baseline/15ce2d3.tar.gz) and this one alternating, 2 rounds: ds-v2-lite 8 layers at
    # 50 / 25 %, qwen3-30b-a3b 16 layers at 25 %
    runtime_gpu_tests 200
    mkdir -p /tmp/old && tar -xzf .baseline/15ce2d3.tar.gz -C /tmp/old
    mkdir -p "$work/baseline"
    for round in 1 2; do
      for tree in old new; do
        dir=$PWD; [ "$tree" = old ] && dir=/tmp/old
        for cell in "ds-v2-lite 8 0.5" "ds-v2-lite 8 0.25" "qwen3-30b-a3b 16 0.25"; do
          set -- $cell
          stage "timeline-$tree-$round-$1-$3" 100 env PYTHONPATH="$dir" bash -c "cd $dir && python3 \
            benchmarks/miss_step_timeline.py --preset $1 --layers $2 --coverage $3 --no-profiler --commit $commit \
            --json $work/$([ "$tree" = old ] && echo baseline/)timeline-$tree-$round-$1-$3.json"
        done
      done
    done
    ;;
  closing10)  # the session's last code: the main job's --verify-resident, the replay benchmark on both presets as
    # replay8 ran it, and the timeline's aligned event clock at ds-v2-lite 50 / 100 %. Stage limits 80 + 120 + 150 +
    # 2 x 60 s. Estimates from earlier calls: ~25 s, ~80 s, ~110 s, ~15 s each.
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    replay_matrix replay-ds 120 ds-v2-lite 8 "$work/replay_ds_closing10.json"
    replay_matrix replay-qwen3 150 qwen3-30b-a3b 16 "$work/replay_qwen3_closing10.json"
    for coverage in 0.5 1.0; do
      stage "timeline-ds-v2-lite-$coverage" 60 python3 benchmarks/miss_step_timeline.py --preset ds-v2-lite --layers 8 \
        --coverage "$coverage" --no-profiler --commit "$commit" --json "$work/timeline-ds-v2-lite-$coverage.json"
    done
    ;;
  events11)  # the route's fork and join with the workspace's two events (kernels/moe_mm.py _route_beside, no event made
    # per call): both pair-order test files (eager and captured), the runtime GPU tests (captured steps fork the route)
    # and the main job's --verify-resident. Stage limits 150 + 200 + 80 s.
    stage pair-tests 150 python3 -m pytest tests/test_cuda_w2_pair_order.py tests/test_cuda_fp4_pair_order.py -m gpu -q
    runtime_gpu_tests 200
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  hostcut2)  # the step's fetch after a read skips the copy stream's wait for compute (its sync finished every kernel),
    # the install groups its rows by layer lazily (the first layer's rows go out first): the runtime GPU tests, the main
    # job's --verify-resident, then the replay benchmark on ds-v2-lite, the tree before (d450051, carried as
    # .baseline/d450051.tar.gz) and this one in turn, and the timeline at ds-v2-lite 25 %. Stage limits 200 + 80 +
    # 2 x 120 + 60 s.
    runtime_gpu_tests 200
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    mkdir -p /tmp/old "$work/baseline" && tar -xzf .baseline/d450051.tar.gz -C /tmp/old
    stage replay-ds-old 120 env PYTHONPATH=/tmp/old bash -c "cd /tmp/old && python3 benchmarks/replay.py \
      --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 --steps 220 --warmup 20 --coverages 1.0,0.5,0.25,0.1 \
      --arena-gb 4 --arena-preload --dtype bfloat16 --commit d450051 --out $work/baseline/replay_ds_old.json"
    replay_matrix replay-ds 120 ds-v2-lite 8 "$work/replay_ds_new.json"
    stage timeline-ds-v2-lite-0.25 60 python3 benchmarks/miss_step_timeline.py --preset ds-v2-lite --layers 8 \
      --coverage 0.25 --no-profiler --commit "$commit" --json "$work/timeline-ds-v2-lite-0.25.json"
    ;;
  located)  # the step's fetch from located arena rows (victims planned while the pass runs, rows by key id, the
    # first copy before the bookkeeping): the runtime GPU tests, the main job's --verify-resident, then the replay
    # benchmark on ds-v2-lite, the tree before (675e2db, carried as .baseline/675e2db.tar.gz) and this one in turn,
    # and the timeline at ds-v2-lite 25 %, old and new. Stage limits 240 + 80 + 2 x 120 + 2 x 60 s.
    runtime_gpu_tests 240
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    mkdir -p /tmp/old "$work/baseline" && tar -xzf .baseline/675e2db.tar.gz -C /tmp/old
    old_replay replay-ds-old 120 ds-v2-lite 8 "$work/baseline/replay_ds_old.json" 675e2db
    replay_matrix replay-ds 120 ds-v2-lite 8 "$work/replay_ds_new.json"
    old_timeline timeline-old-ds-v2-lite-0.25 60 ds-v2-lite 8 0.25 "$work/baseline/timeline-old-ds-v2-lite-0.25.json" 675e2db
    stage timeline-ds-v2-lite-0.25 60 python3 benchmarks/miss_step_timeline.py --preset ds-v2-lite --layers 8 \
      --coverage 0.25 --no-profiler --commit "$commit" --json "$work/timeline-ds-v2-lite-0.25.json"
    ;;
  located2)  # after the located fetch's residency filter (the negative control of layer waits logs resident keys as
    # missing): the runtime GPU tests again, the same A/B on qwen3-30b-a3b (16 layers), then a second round on
    # ds-v2-lite, new before old this time. Stage limits 200 + 2 x 150 + 2 x 120 s.
    runtime_gpu_tests 200
    mkdir -p /tmp/old "$work/baseline" && tar -xzf .baseline/675e2db.tar.gz -C /tmp/old
    old_replay replay-qwen3-old 150 qwen3-30b-a3b 16 "$work/baseline/replay_qwen3_old.json" 675e2db
    replay_matrix replay-qwen3 150 qwen3-30b-a3b 16 "$work/replay_qwen3_new.json"
    replay_matrix replay-ds-2 120 ds-v2-lite 8 "$work/replay_ds_new_2.json"
    old_replay replay-ds-old-2 120 ds-v2-lite 8 "$work/baseline/replay_ds_old_2.json" 675e2db
    ;;
  located3)  # order-balanced A/B of the located fetch with the event clock (miss_step_timeline.py --no-profiler): the
    # tree before (675e2db) and this one, 3 rounds in the order old new / new old / old new, ds-v2-lite 8 layers at 50 %
    # and qwen3-30b-a3b 16 layers at 25 %. Stage limit 60 s each (7-13 s measured in located).
    mkdir -p /tmp/old "$work/baseline" && tar -xzf .baseline/675e2db.tar.gz -C /tmp/old
    timeline_ab 675e2db
    ;;
  syncwake)  # how soon the host learns that a pass ended: benchmarks/sync_wake.py, the pass log's read-back ways
    # (copy + stream sync, copy + event sync, copy + stamp spun on, bare sync) interleaved on one captured pass, with the
    # log of ds-v2-lite 8 layers (1.6k words) and of qwen3-30b-a3b 16 layers (6.2k). Stage limit 60 s each.
    stage sync-wake-1600 60 python3 benchmarks/sync_wake.py --iterations 400 --words 1600 --commit "$commit" \
      --json "$work/sync_wake_1600.json"
    stage sync-wake-6200 60 python3 benchmarks/sync_wake.py --iterations 400 --words 6200 --commit "$commit" \
      --json "$work/sync_wake_6200.json"
    ;;
  closing11)  # the session's last code (pass reports' routed ids computed late, the located fetch's residency filter
    # in the policy's keys): the runtime GPU tests, the main job's --verify-resident, the event-clock A/B against the
    # located fetch before them (27a48d4, carried as .baseline/27a48d4.tar.gz) as located3 ran it, then the replay
    # benchmark on both presets. Stage limits 200 + 80 + 12 x 60 + 120 + 150 s (~75 + 15 + 12 x 10 + 45 + 55 measured).
    runtime_gpu_tests 200
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    mkdir -p /tmp/old "$work/baseline" && tar -xzf .baseline/27a48d4.tar.gz -C /tmp/old
    timeline_ab 27a48d4
    replay_matrix replay-ds 120 ds-v2-lite 8 "$work/replay_ds_closing11.json"
    replay_matrix replay-qwen3 150 qwen3-30b-a3b 16 "$work/replay_qwen3_closing11.json"
    ;;
  planvariant)  # closing11 found qwen3-30b-a3b's miss steps slower at its code than at 27a48d4 (the first copy
    # later, the syncs later too): which change? 27a48d4, this tree, and a1d77a4 (this tree with the plan size of
    # 27a48d4), event clock at qwen3-30b-a3b 16 layers 25 % and ds-v2-lite 8 layers 50 %, 2 rounds in the orders
    # old new v1 / v1 new old. Stage limit 60 s each (~10 s measured).
    for tree in 27a48d4 a1d77a4; do mkdir -p "/tmp/$tree" && tar -xzf ".baseline/$tree.tar.gz" -C "/tmp/$tree"; done
    mkdir -p "$work/baseline"
    for round in 1 2; do
      order="27a48d4 new a1d77a4"; [ "$round" = 2 ] && order="a1d77a4 new 27a48d4"
      for tree in $order; do
        for cell in "qwen3-30b-a3b 16 0.25" "ds-v2-lite 8 0.5"; do
          set -- $cell
          if [ "$tree" = new ]; then
            stage "timeline-new-$round-$1-$3" 60 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" \
              --coverage "$3" --no-profiler --commit "$commit" --json "$work/timeline-new-$round-$1-$3.json"
          else
            stage "timeline-$tree-$round-$1-$3" 60 env PYTHONPATH="/tmp/$tree" bash -c "cd /tmp/$tree && python3 \
              benchmarks/miss_step_timeline.py --preset $1 --layers $2 --coverage $3 --no-profiler --commit $tree \
              --json $work/baseline/timeline-$tree-$round-$1-$3.json"
          fi
        done
      done
    done
    ;;
  pinning)  # the runs' host speed moves by process (planvariant: one ds-v2-lite run's read started 70 us before the pass's
    # end against 125-137 in the five others): the machine's CPU / GPU topology, then the event clock at ds-v2-lite 8
    # layers 50 % and qwen3-30b-a3b 16 layers 25 %, each run pinned (taskset) to four of the GPU's local cores and not,
    # 2 rounds. Stage limit 60 s each.
    { nvidia-smi topo -m; lscpu | grep -iE "model name|numa|^cpu\(s\)|mhz"; } > "$work/topology.log" 2>&1
    local_cpus=$(nvidia-smi topo -m 2>/dev/null | awk '/^GPU0/ {for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$/ && $i ~ /-/) {print $i; exit}}')
    first=${local_cpus%%-*}; first=${first%%,*}
    pinned_cpus=$(( ${first:-0} + 2 ))-$(( ${first:-0} + 5 ))  # four of the local cores, clear of core 0's interrupts
    echo "GPU0 CPU affinity: ${local_cpus:-unknown}; pinned runs on cores $pinned_cpus" | tee -a "$work/summary.txt"
    for round in 1 2; do
      for mode in pinned free; do
        for cell in "ds-v2-lite 8 0.5" "qwen3-30b-a3b 16 0.25"; do
          set -- $cell
          prefix=""; [ "$mode" = pinned ] && prefix="taskset -c $pinned_cpus"
          stage "timeline-$mode-$round-$1-$3" 60 $prefix python3 benchmarks/miss_step_timeline.py --preset "$1" \
            --layers "$2" --coverage "$3" --no-profiler --commit "$commit" --json "$work/timeline-$mode-$round-$1-$3.json"
        done
      done
    done
    ;;
  passgather)  # the pass's own fetch (config gather_in_pass): its GPU tests (the CUDA plan and copy against the reference,
    # the runtime eager and in a graph) and the runtime's other GPU tests, the quality checkpoint's --verify-resident
    # with it, then the replay benchmark with --compare-config gather_in_pass=1 (the default and the gather in one
    # process) on ds-v2-lite 8 layers (50 / 25 / 10 %) and qwen3-30b-a3b 16 layers (50 / 25 %). Stage limits
    # 240 + 80 + 150 + 150 s.
    stage gather-tests 240 python3 -m pytest tests/test_runtime_pass_gather.py tests/test_runtime_gpu.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_located_fetch.py tests/test_runtime_cuda_w2.py -m gpu -q
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --gather-in-pass --verify-resident
    for cell in "ds-v2-lite 8 0.5,0.25,0.1" "qwen3-30b-a3b 16 0.5,0.25"; do
      set -- $cell
      stage "replay-$1" 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" --steps 220 \
        --warmup 20 --coverages "$3" --arena-gb 4 --arena-preload --dtype bfloat16 --compare-config gather_in_pass=1 \
        --commit "$commit" --out "$work/replay_$1_gather.json"
    done
    ;;
  passgather2)  # passgather after the host side's cut (the pass's mappings and the spares written element by element,
    # no array call per field): the replay benchmark with --compare-config gather_in_pass=1 on both presets at 50 and
    # 25 %, two rounds (each cell's default and gather runs share one process, the default first). Stage limits 120 s
    # each.
    compare_rounds gather2 120 gather_in_pass=1 2 0.5,0.25
    ;;
  mend12)  # GPU checks of host-side mends: the FP4 kernel tests' shared case built per module (no imported fixture),
    # the decaying miss count updated by each read; the runtime's GPU tests with the pass's own fetch. Stage limits
    # 200 + 250 s.
    stage fp4-case-tests 200 python3 -m pytest tests/test_cuda_fp4_decode_mad.py tests/test_cuda_fp4_pair_order.py -m gpu -q
    stage runtime-tests 250 python3 -m pytest tests/test_runtime_pass_gather.py tests/test_runtime_gpu.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_located_fetch.py tests/test_runtime_early_fetch.py \
      tests/test_runtime_pool_copies.py tests/test_runtime_fetch_split.py tests/test_runtime_cuda_w2.py -m gpu -q
    ;;
  closing12)  # the tenth session's last code on the default path (gather_in_pass off): the main job's --verify-resident
    # on the quality checkpoint, then the replay benchmark on both presets as replay8 / closing11 ran it. Stage limits
    # 80 + 120 + 150 s.
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    replay_matrix replay-ds 120 ds-v2-lite 8 "$work/replay_ds_closing12.json"
    replay_matrix replay-qwen3 150 qwen3-30b-a3b 16 "$work/replay_qwen3_closing12.json"
    ;;
  mend12b)  # GPU checks after the review of the tenth session's change: the pass's fetch tests (the torch backend's
    # refusal on CUDA added), the layer-waits tests on the shared graph helper, and h2d_gather.py on the row kernel
    # now in kernels/cuda/pass_gather.cu (12 rows, few rounds: that it runs and checks its bytes). Stage limits
    # 200 + 60 s.
    stage runtime-tests 200 python3 -m pytest tests/test_runtime_pass_gather.py tests/test_runtime_layer_waits.py -m gpu -q
    stage h2d-gather 60 python3 benchmarks/h2d_gather.py --rows 12 --rounds 10 --commit "$commit"
    ;;
  gatherclock)  # where the pass's own fetch spends its step: miss_step_timeline.py (event clock, then the profiler)
    # with and without --gather-in-pass at ds-v2-lite 8 layers 50 / 25 % and qwen3-30b-a3b 16 layers 50 %, the order
    # alternating per cell. Stage limits 90 s each.
    for cell in "ds-v2-lite 8 0.5 default gather" "ds-v2-lite 8 0.25 gather default" \
                "qwen3-30b-a3b 16 0.5 default gather"; do
      set -- $cell
      for mode in "$4" "$5"; do
        flag=""; [ "$mode" = gather ] && flag="--gather-in-pass"
        stage "timeline-$mode-$1-$3" 90 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" \
          --coverage "$3" $flag --commit "$commit" --json "$work/timeline-$mode-$1-$3.json"
      done
    done
    ;;
  passgather3)  # the pass's own fetch with its host work off the step's path (spares staged while the pass before
    # runs and checked by the device when used, the pass's mappings recorded at the next read): its GPU tests, the
    # quality checkpoint's --verify-resident with it, and the replay benchmark with --compare-config
    # gather_in_pass=1 on both presets at 50 / 25 %, two rounds. Stage limits 150 + 60 + 4 x 90 s.
    stage gather-tests 150 python3 -m pytest tests/test_runtime_pass_gather.py -m gpu -q
    stage generate-quality 60 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --gather-in-pass --verify-resident
    compare_rounds gather3 90 gather_in_pass=1 2 0.5,0.25
    ;;
  pair)  # the pass pair (config pass_pair, eleventh session): its GPU tests and the pass gather's (the plan kernel
    # now writes a given rows word, the copy reads it), then the replay benchmark with --compare-config pass_pair=1
    # on both presets at 50 / 25 / 10 %, one round. Stage limits 220 + 2 x 150 s.
    stage pair-tests 220 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py -m gpu -q
    compare_rounds pair 150 pass_pair=1 1 0.5,0.25,0.1
    ;;
  pair2)  # the pass pair's GPU tests (the negative control joining at the last layer; the gather's tests in their
    # own process), then its side stream's copy grid: ds-v2-lite 8 layers at 50 / 25 %, --compare-config pass_pair=1
    # with pass_pair_copy_blocks 4, 16, 64 (the pair's default, two per SM, ran in step pair), and qwen3-30b-a3b 16
    # layers at 50 % with 16. Stage limits 150 + 100 + 4 x 70 s.
    stage pair-tests 150 python3 -m pytest tests/test_runtime_pass_pair.py -m gpu -q
    stage gather-tests 100 python3 -m pytest tests/test_runtime_pass_gather.py -m gpu -q
    for blocks in 4 16 64; do
      stage "replay-ds-blocks$blocks" 70 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite \
        --layers 8 --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config pass_pair=1 --compare-config pass_pair_copy_blocks=$blocks --commit "$commit" \
        --out "$work/replay_ds_pair_blocks$blocks.json"
    done
    stage replay-qwen3-blocks16 70 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
      --layers 16 --steps 220 --warmup 20 --coverages 0.5 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config pass_pair=1 --compare-config pass_pair_copy_blocks=16 --commit "$commit" \
      --out "$work/replay_qwen3_pair_blocks16.json"
    ;;
  pair3)  # the pass pair's copy grid, narrower (pair2: 4 blocks beat 16 and 64 at ds-v2-lite 50 %): ds-v2-lite 8
    # layers at 50 / 25 / 10 % with pass_pair_copy_blocks 2, 4, 8, and qwen3-30b-a3b 16 layers at 50 / 25 % with 4
    # and 8, each against the default path in its process. Stage limits 3 x 60 + 2 x 60 s.
    for blocks in 2 4 8; do
      stage "replay-ds-blocks$blocks" 60 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite \
        --layers 8 --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config pass_pair=1 --compare-config pass_pair_copy_blocks=$blocks --commit "$commit" \
        --out "$work/replay_ds_pair_blocks$blocks.json"
    done
    for blocks in 4 8; do
      stage "replay-qwen3-blocks$blocks" 60 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
        --layers 16 --steps 220 --warmup 20 --coverages 0.5,0.25 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config pass_pair=1 --compare-config pass_pair_copy_blocks=$blocks --commit "$commit" \
        --out "$work/replay_qwen3_pair_blocks$blocks.json"
    done
    ;;
  pair4)  # the pass pair as it now stands (copy grid 4 blocks by default; 8 single-pass steps after a pair that
    # gathered fewer experts than it missed): its GPU tests, then --compare-config pass_pair=1 on both presets at
    # 50 / 25 / 10 %, two rounds. Stage limits 150 + 4 x 90 s.
    stage pair-tests 150 python3 -m pytest tests/test_runtime_pass_pair.py -m gpu -q
    compare_rounds pair4 90 pass_pair=1 2 0.5,0.25,0.1
    ;;
  pair5)  # GPU check after the tests' shared CUDA decode-steps helper: the pair's and the gather's GPU tests. Stage
    # limit 200 s.
    stage tests 200 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py -m gpu -q
    ;;
  pair6)  # the pass pair in `tierstore generate` (the pair captured as a second graph, the cache's position stepped
    # back inside it): the runtime's GPU generation tests with and without it, the pair's GPU tests, and the main job's
    # --verify-resident on the quality checkpoint with --pass-pair. Stage limits 250 + 80 s.
    stage tests 250 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_pass_pair.py -m gpu -q
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --pass-pair --verify-resident
    ;;
  pair7)  # the pass pair with engine copies (pass_pair_copies engine: the host issues each layer's rows on a copy
    # stream as soon as the pass planned them, the replay waits on a flag): the pair's and the gather's GPU tests
    # (kernel and engine), then --compare-config pass_pair=1 + pass_pair_copies=engine against the default path on
    # both presets at 50 / 25 / 10 %, one round. Stage limits 200 + 2 x 100 s.
    stage tests 200 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py -m gpu -q
    for cell in "ds-v2-lite 8" "qwen3-30b-a3b 16"; do
      set -- $cell
      stage "replay-$1" 100 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" --steps 220 \
        --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config pass_pair=1 --compare-config pass_pair_copies=engine --commit "$commit" \
        --out "$work/replay_$1_pair7.json"
    done
    ;;
  pairclock2)  # a pass pair's device time against its step's wall time (benchmarks/pair_clock.py, CUDA events around
    # the pair's launch, host marks before it): ds-v2-lite 8 layers and qwen3-30b-a3b 16 layers at 50 % with kernel
    # copies, qwen3-30b-a3b 50 % with engine copies. Stage limits 3 x 80 s.
    for cell in "ds-v2-lite 8 0.5 kernel" "qwen3-30b-a3b 16 0.5 kernel" \
                "qwen3-30b-a3b 16 0.5 engine"; do
      set -- $cell
      stage "pairclock-$1-$3-$4" 80 python3 benchmarks/pair_clock.py --preset "$1" --layers "$2" --coverage "$3" \
        --copies "$4" --commit "$commit" --json "$work/pairclock-$1-$3-$4.json"
    done
    ;;
  closing13)  # the eleventh session's last code: --compare-config pass_pair=1 (kernel copies, the plan kernel now
    # fencing its descriptors) against the default path on both presets at 50 / 25 / 10 %, one round. Stage limits
    # 2 x 100 s.
    compare_rounds closing13 100 pass_pair=1 1 0.5,0.25,0.1
    ;;
  choice)  # the pass pair's timed choice (config pass_pair_choice timed, the default: pair or single pass by their
    # recent step times; twelfth session): the GPU tests of the pair, the gather and the runtime's generation
    # (also the GPU check of 2df63f2's review mend), then --compare-config pass_pair=1 against the default
    # path on both presets at 50 / 25 / 10 %, two rounds, and the timed choice against always (--config pass_pair=1
    # --compare-config pass_pair_choice=always), one round. Stage limits 240 + 6 x 90 s.
    stage tests 240 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py \
      tests/test_runtime_gpu.py -m gpu -q
    compare_rounds choice 90 pass_pair=1 2 0.5,0.25,0.1
    for cell in "ds-v2-lite 8" "qwen3-30b-a3b 16"; do
      set -- $cell
      stage "replay-$1-always" 90 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" \
        --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --config pass_pair=1 --compare-config pass_pair_choice=always --commit "$commit" \
        --out "$work/replay_$1_choice_always.json"
    done
    ;;
  choice2)  # the timed choice with spares staged only for a step that is to pair (choice: single steps of a
    # pair-enabled runtime at 10 % had a slower host fetch, the staged spares taking the victims its plan had): the
    # GPU tests as in choice, then --compare-config pass_pair=1 against the default path, two rounds. Stage limits
    # 240 + 4 x 90 s.
    stage tests 240 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py \
      tests/test_runtime_gpu.py -m gpu -q
    compare_rounds choice2 90 pass_pair=1 2 0.5,0.25,0.1
    ;;
  closing14)  # pass_pair auto by default (on CUDA with the triton backend and an arena, the timed choice): the
    # runtime's and the FP4 tier's GPU tests (every runtime there with an arena now pairs unless told not to), the
    # main job on the quality checkpoint with the defaults (--verify-resident), then --compare-config pass_pair=0 (the
    # single-pass path) against the default on both presets at 50 / 25 / 10 %, one round. Stage limits 300 + 80 +
    # 2 x 100 s.
    stage tests 300 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_layer_waits.py tests/test_runtime_early_fetch.py tests/test_runtime_cuda_w2.py \
      tests/test_runtime_located_fetch.py tests/test_runtime_fetch_split.py tests/test_runtime_pass_pair.py \
      tests/test_runtime_pass_gather.py tests/test_fp4_gpu.py -m gpu -q
    stage generate-quality 80 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    compare_rounds closing14 100 pass_pair=0 1 0.5,0.25,0.1
    ;;
  closing14b)  # the twelfth session's last code (the timed choice exploring every 64th step while the other kind is
    # over 1.1x slower): the pair's and the generation GPU tests, then --compare-config pass_pair=0 against the
    # default (auto) on both presets at 50 / 25 / 10 %, two rounds. Stage limits 150 + 4 x 100 s.
    stage tests 150 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_gpu.py -m gpu -q
    compare_rounds closing14b 100 pass_pair=0 2 0.5,0.25,0.1
    ;;
  closing14c)  # the timed choice without the back-off (a short pair is a slow sample; closing14b: isolated short
    # pairs at qwen3-30b-a3b 50 % sent 8 steps each to single passes), 5 times per kind, the slower kind every 32nd
    # step while over 1.1x slower: the pair's GPU tests, then --compare-config pass_pair=0 against the default on both
    # presets at 50 / 25 / 10 %, two rounds. Stage limits 120 + 4 x 100 s.
    stage tests 120 python3 -m pytest tests/test_runtime_pass_pair.py -m gpu -q
    compare_rounds closing14c 100 pass_pair=0 2 0.5,0.25,0.1
    ;;
  fp4pair2)  # the pass pair beside the FP4 tier and the gate on the GPU (the fired run pairing every step likely to
    # miss, captured as the generator's second graph, against the all-FP4 reference): the FP4 tier's GPU tests. Stage
    # limit 150 s.
    stage tests 150 python3 -m pytest tests/test_fp4_gpu.py -q
    ;;
  closing15)  # thirteenth session: the full pool's steps no longer tell its policy what they routed, and the replay
    # JSON splits each window by step kind (pair / single, with the host's forward-call, read-prep and read times):
    # the pair's and the runtime's GPU tests, then --compare-config pass_pair=0 against the default on both presets
    # at 100 / 50 / 25 / 10 %, 600 steady steps, two rounds in alternated order. Stage limits 120 + 4 x 110 s.
    stage tests 120 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_gpu.py -m gpu -q
    compare_rounds closing15 110 pass_pair=0 2 1,0.5,0.25,0.1 alternate 620
    ;;
  stagewake)  # the pass writing its own log read-back (benchmarks/log_stage.cu; kernels/cuda/ at 3a5351d) against the
    # copy after it:
    # the staging kernel's GPU tests, then benchmarks/sync_wake.py with the staged variants (kernel, captured memcpy)
    # beside the earlier ways, at ds-v2-lite's and qwen3-30b-a3b's log sizes. Stage limits 90 + 2 x 60 s.
    stage tests 90 python3 -m pytest tests/test_bench_log_stage.py -q
    stage sync-wake-1600 60 python3 benchmarks/sync_wake.py --iterations 600 --words 1600 --commit "$commit" \
      --json "$work/sync_wake_1600.json"
    stage sync-wake-6200 60 python3 benchmarks/sync_wake.py --iterations 600 --words 6200 --commit "$commit" \
      --json "$work/sync_wake_6200.json"
    ;;
  blocks15)  # the pass pair's copy grid on qwen3-30b-a3b (only ds-v2-lite 50 % was measured, pair2 / pair3): the
    # default 4 blocks interleaved step by step against 8 at 50 / 25 % and against 16 at 50 %, both presets, 400
    # steady steps. Stage limits 2 x 90 + 2 x 70 s.
    compare_rounds blocks15-8 90 pass_pair_copy_blocks=8 1 0.5,0.25 interleave 420
    compare_rounds blocks15-16 70 pass_pair_copy_blocks=16 1 0.5 interleave 420
    ;;
  final15)  # the thirteenth session's last code: the staging kernel's tests at its new place (benchmarks/), the pair's,
    # the runtime's and the FP4 tier's GPU tests. Stage limit 200 s.
    stage tests 200 python3 -m pytest tests/test_bench_log_stage.py tests/test_runtime_pass_pair.py \
      tests/test_runtime_gpu.py tests/test_runtime_located_fetch.py tests/test_fp4_gpu.py -m gpu -q
    ;;
  unread16)  # fourteenth session: a full pool's decode steps read no pass (config full_pool_reads off, the default):
    # the unread step's and the runtime's GPU tests, then at 100 % on both presets the default (steps unread, the
    # decoder's own token readback) interleaved step by step with full_pool_reads=1 (every pass read, the token folded
    # into it), 600 steady steps, two rounds; each cell's nomiss_overhead times the unread steps beside plain and
    # plain_readback on the same rotation. Stage limits 150 + 4 x 90 s.
    stage tests 150 python3 -m pytest tests/test_runtime_unread.py tests/test_runtime_gpu.py -m gpu -q
    compare_rounds unread16 90 full_pool_reads=1 2 1 interleave 620
    ;;
  pairclock16)  # whether the device waits for the pair graph's launch (pairclock2: the pair's device time 1036 us at
    # qwen3-30b-a3b 50 % against ~755 us for its parts, its launch ~70 us of host time): benchmarks/pair_clock.py with
    # every other pair step held behind a 1 ms device sleep (its graph fully submitted before its first event), and the
    # single-pass graph's launch alone, at ds-v2-lite 8 layers and qwen3-30b-a3b 16 layers, 50 %. Stage limits 2 x 90 s.
    for cell in "ds-v2-lite 8" "qwen3-30b-a3b 16"; do
      set -- $cell
      stage "pairclock-$1" 90 python3 benchmarks/pair_clock.py --preset "$1" --layers "$2" --coverage 0.5 \
        --steps 80 --hold-us 1000 --commit "$commit" --json "$work/pairclock-$1-0.5-held.json"
    done
    ;;
  pairprof16|pairprof16b|pairprof16c)  # where the pair's device time goes (pairclock16: the device does not wait for the pair's
    # launch): benchmarks/pair_clock.py --profile-steps, each profiled pair step cut into its first pass, its replay's
    # busy and waiting time, and the side stream's row copies (pairprof16b, whose pair_clock.py has them: then 8 single passes
    # profiled for scale; pairprof16c: and the device time by kernel name in each pass), at ds-v2-lite 8 layers and qwen3-30b-a3b 16 layers, 50 %. Stage limits 2 x 120 s.
    for cell in "ds-v2-lite 8" "qwen3-30b-a3b 16"; do
      set -- $cell
      stage "pairprof-$1" 120 python3 benchmarks/pair_clock.py --preset "$1" --layers "$2" --coverage 0.5 \
        --steps 40 --profile-steps 24 --commit "$commit" --json "$work/pairprof-$1-0.5.json"
    done
    ;;
  plans16)  # the pass pair's plans on a stream of their own (config pass_pair_plans stream, the default; pairprof16c:
    # the 16 plans of a qwen3-30b-a3b first pass took 109 us on its path): the pair's GPU tests (plans held back, both
    # placements), then the default interleaved step by step with pass_pair_plans=inline on both presets at 50 / 25 /
    # 10 %, 400 steady steps. Stage limits 200 + 2 x 110 s.
    stage tests 200 python3 -m pytest tests/test_runtime_pass_pair.py -m gpu -q
    compare_rounds plans16 110 pass_pair_plans=inline 1 0.5,0.25,0.1 interleave 420
    ;;
  closing16)  # the fourteenth session's last code: the runtime's and the unread step's GPU tests, then
    # --compare-config pass_pair=0 against the default on both presets at 100 / 50 / 25 / 10 %, 600 steady steps,
    # two rounds in alternated order (closing15's method). Stage limits 150 + 4 x 110 s.
    stage tests 150 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_unread.py -m gpu -q
    compare_rounds closing16 110 pass_pair=0 2 1,0.5,0.25,0.1 alternate 620
    ;;
  final16)  # the fourteenth session's last code on real model code: the pass gather's and the FP4 tier's GPU tests
    # (both launch plans), then the main job on the quality checkpoint with --verify-resident at a 25 % pool (pairs, their
    # plans on their own stream) and at a full pool (its steps unread once every expert is installed). Stage limits
    # 200 + 2 x 80 s.
    stage tests 200 python3 -m pytest tests/test_runtime_pass_gather.py tests/test_fp4_gpu.py -m gpu -q
    main_job_both_pools 80
    ;;
  closing16b)  # two more rounds of closing16 at 50 / 25 %, where it missed the target at ds-v2-lite 50 % and
    # qwen3-30b-a3b 25 % (the same method, the same runtime). Stage limits 4 x 100 s.
    compare_rounds closing16b 100 pass_pair=0 2 0.5,0.25 alternate 620
    ;;
  closing17)  # closing16's cells with every timed run but the naive one interleaved step by step (the resident runs,
    # the default, single passes: --interleave since the fourteenth session), so the floor's resident step sees the
    # same host as the tiered ones; both presets at 100 / 50 / 25 / 10 %, 600 steady steps, two rounds. Prepared in
    # the fourteenth session, run in the fifteenth. Stage limits 4 x 140 s (closing16's stages took 70-105 s).
    compare_rounds closing17 140 pass_pair=0 2 1,0.5,0.25,0.1 interleave 620
    ;;
  closing18)  # closing17's cells and method at the fifteenth session's timed choice (samples only after a step of
    # their own kind, runs of two when a kind is tried, the mean decides; reverted after this run: run the step from
    # 089e588). Stage limits 4 x 140 s.
    compare_rounds closing18 140 pass_pair=0 2 1,0.5,0.25,0.1 interleave 620
    ;;
  final17)  # the fifteenth session's last code (closing17's runtime; closing18's choice reverted): the runtime's GPU
    # tests, the main job on the quality checkpoint with --verify-resident at a 25 % and a full pool, then two more
    # rounds of closing17 at 50 / 25 % (replay files named closing17b). Stage limits 120 + 2 x 50 + 4 x 90 s.
    stage tests 120 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_unread.py \
      tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py -m gpu -q
    main_job_both_pools 50
    compare_rounds closing17b 90 pass_pair=0 2 0.5,0.25 interleave 620
    ;;
  recent17)  # config gather_keeps_recent: the pass gather's and the pair's GPU tests, then the default (a pair's
    # spares skip a victim the pass before routed) against gather_keeps_recent=0 (taken like any other), interleaved,
    # at 50 / 25 %, 600 steady steps, two rounds. Stage limits 90 + 4 x 90 s.
    stage tests 90 python3 -m pytest tests/test_runtime_pass_gather.py tests/test_runtime_pass_pair.py -m gpu -q
    compare_rounds recent17 90 gather_keeps_recent=0 2 0.5,0.25 interleave 620
    ;;
  recent17b)  # gather_keeps_recent off by default since recent17: the main job on the quality checkpoint with
    # --verify-resident at a 25 % pool, then the default against gather_keeps_recent=1, interleaved, at 25 / 10 %, one
    # round (ds-v2-lite, then qwen3-30b-a3b). Stage limits 50 + 70 + 110 s.
    stage generate-quality 50 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    stage replay-recent17b-ds-v2-lite-1 70 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite \
      --layers 8 --steps 620 --warmup 20 --coverages 0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config gather_keeps_recent=1 --interleave --commit "$commit" --out "$work/replay_ds-v2-lite_recent17b_1.json"
    stage replay-recent17b-qwen3-30b-a3b-1 110 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
      --layers 16 --steps 620 --warmup 20 --coverages 0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config gather_keeps_recent=1 --interleave --commit "$commit" \
      --out "$work/replay_qwen3-30b-a3b_recent17b_1.json"
    ;;
  closing19)  # closing17's method at the fifteenth session's last code (gather_keeps_recent off by default): both
    # presets at 100 / 50 / 25 / 10 %, the resident runs, the default and single passes interleaved, 600 steady steps,
    # two rounds. Prepared in the fifteenth session, run in the sixteenth at 9fd1975. Stage limits 4 x 140 s.
    compare_rounds closing19 140 pass_pair=0 2 1,0.5,0.25,0.1 interleave 620
    ;;
  final19)  # the sixteenth session's last code (the timed choice explores the losing kind 16, 32, then 64 eligible
    # steps apart): the runtime's GPU tests, the main job on the quality checkpoint with --verify-resident at a 25 %
    # and a full pool, then closing19's method (both presets at 100 / 50 / 25 / 10 %, interleaved, 600 steady steps),
    # two rounds. Stage limits 120 + 2 x 50 + 4 x 140 s.
    stage tests 120 python3 -m pytest tests/test_runtime_gpu.py tests/test_runtime_unread.py \
      tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py tests/test_runtime_pair_choice.py -m gpu -q
    main_job_both_pools 50
    compare_rounds final19 140 pass_pair=0 2 1,0.5,0.25,0.1 interleave 620
    ;;
  final19b)  # final19's code: two more rounds of its replays at the coverages that miss (50 / 25 / 10 %), for the
    # narrowest cell (qwen3-30b-a3b 10 %: 1.229x / 1.244x the floor in final19). Stage limits 4 x 120 s.
    compare_rounds final19b 120 pass_pair=0 2 0.5,0.25,0.1 interleave 620
    ;;
  copies20)  # seventeenth session: the pair's side-stream copy rate. benchmarks/h2d_gather.py at qwen3-30b-a3b's slot
    # (1327104 B) with the 10 % step's 80 rows and the 50 % step's 24 over 16 layers: the copy engine per row against
    # the pair's kernel (gather_pass_rows, a fixed grid per layer) at 4-64 blocks and 8 / 16 loads in flight; then
    # pairs on every step likely to miss, the default 4 blocks against 16 blocks and against engine copies
    # (qwen3-30b-a3b 25 / 10 %), and against 16 blocks on ds-v2-lite 50 / 25 / 10 %, 300 steady steps.
    # Stage limits 2 x 60 + 3 x 100 s.
    for rows in 80 24; do
      stage "h2d-pass-$rows" 60 python3 benchmarks/h2d_gather.py --row-bytes 1327104 --rows "$rows" --layers 16 \
        --blocks 4 --pass-grids 4,8,16,32,64 --unrolls 8,16 --rounds 40 --commit "$commit" \
        --json "$work/h2d_pass_$rows.json"
    done
    pair_compare copies20-b16 100 pass_pair_copy_blocks=16 qwen3-30b-a3b 16 0.25,0.1 320
    pair_compare copies20-engine 100 pass_pair_copies=engine qwen3-30b-a3b 16 0.25,0.1 320
    pair_compare copies20-b16 100 pass_pair_copy_blocks=16 ds-v2-lite 8 0.5,0.25,0.1 320
    ;;
  spares20)  # config gather_spares_per_miss (4 by default since this step's tree; 2 before) and the pair's copy grid
    # (copies20: 16 blocks beat 4 in every cell), at the timed choice (the default), interleaved, 300 steady steps:
    # 4 against 2 spares a miss with 16 blocks (qwen3-30b-a3b); 16 against 4 blocks at 4 a miss (both presets); 16
    # blocks against single passes (both presets: tiered / floor); 32 against 16 blocks (qwen3-30b-a3b 50 / 10 %).
    # Stage limits 3 x 90 + 2 x 70 + 60 s.
    pair_compare spares20-depth2 90 gather_spares_per_miss=2 qwen3-30b-a3b 16 0.5,0.25,0.1 320 pass_pair_copy_blocks=16
    for cell in "qwen3-30b-a3b 16 90" "ds-v2-lite 8 70"; do
      set -- $cell
      pair_compare spares20-blocks4 "$3" pass_pair_copy_blocks=4 "$1" "$2" 0.5,0.25,0.1 320 pass_pair_copy_blocks=16
      pair_compare spares20-single "$3" pass_pair=0 "$1" "$2" 0.5,0.25,0.1 320 pass_pair_copy_blocks=16
    done
    pair_compare spares20-blocks32 60 pass_pair_copy_blocks=32 qwen3-30b-a3b 16 0.5,0.1 320 pass_pair_copy_blocks=16
    ;;
  grid20)  # the seventeenth session's code: the pair's copy grid timed between 4 and 16 blocks (config
    # pass_pair_wide_blocks, default 16; the copy kernel's working blocks a device word) and 4 spares a miss: the GPU
    # tests of the pair, the pass gather (the copy with fewer working blocks), the choice, the runtime and the unread
    # step; the main job on the quality checkpoint at a 25 % and a full pool; then the default against single passes
    # (both presets, 100 / 50 / 25 / 10 %) and against the narrow grid alone (qwen3-30b-a3b 50 / 25 / 10 %),
    # interleaved, 300 steady steps. Stage limits 130 + 2 x 45 + 110 + 70 + 90 s.
    stage tests 130 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py \
      tests/test_runtime_pair_choice.py tests/test_runtime_gpu.py tests/test_runtime_unread.py -m gpu -q
    main_job_both_pools 45
    pair_compare grid20-single 110 pass_pair=0 qwen3-30b-a3b 16 1,0.5,0.25,0.1 320 pass_pair=auto
    pair_compare grid20-single 70 pass_pair=0 ds-v2-lite 8 1,0.5,0.25,0.1 320 pass_pair=auto
    pair_compare grid20-narrow 90 pass_pair_wide_blocks=0 qwen3-30b-a3b 16 0.5,0.25,0.1 320 pass_pair=auto
    ;;
  closing20)  # grid20's code: two more rounds of the default against single passes at the coverages that miss
    # (both presets, 50 / 25 / 10 %), interleaved, 400 steady steps. Stage limits 4 x 100 s.
    for round in 1 2; do
      pair_compare "closing20-$round" 100 pass_pair=0 qwen3-30b-a3b 16 0.5,0.25,0.1 420 pass_pair=auto
      pair_compare "closing20-$round" 100 pass_pair=0 ds-v2-lite 8 0.5,0.25,0.1 420 pass_pair=auto
    done
    ;;
  recorded20)  # grid20's code on the trace recorded by `tierstore generate` (as `recorded` ran it at 54fb697, the
    # last time): 4 GiB arena preloaded, 50 / 25 / 10 %, the default against single passes interleaved, 220 steady
    # steps. Stage limits 75 + 95 s.
    for cell in "ds-v2-lite 8 first 75" "qwen3-30b-a3b 16 tile 95"; do
      set -- $cell
      stage "replay-recorded20-$1" "$4" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" \
        --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 --no-synthetic \
        --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers "$3" --trace-top-k trace \
        --compare-config pass_pair=0 --interleave --commit "$commit" --out "$work/replay_$1_recorded20.json"
    done
    ;;
  nomiss21)  # eighteenth session: where a no-miss step of a pool that can miss spends more than a full pool's, on the
    # trace recorded by `tierstore generate` (most of its steps at 50 % miss nothing): the event clock and the
    # profiler (miss_step_timeline.py --recorded, single passes) at 50 % and at a full pool that reads every pass
    # (--full-pool-reads), both presets; then single passes against single passes without layer waits (replay.py
    # --config pass_pair=0 --compare-config layer_waits=0, interleaved, 220 steady steps, 50 %). Stage limits
    # 4 x 90 + 2 x 60 s.
    trace=benchmarks/traces/generate-quality-checkpoint.npz
    for cell in "ds-v2-lite 8 first" "qwen3-30b-a3b 16 tile"; do
      set -- $cell
      for cov in 0.5 1; do
        reads=()
        [ "$cov" = 1 ] && reads=(--full-pool-reads)
        stage "timeline-$1-$cov" 90 python3 benchmarks/miss_step_timeline.py --preset "$1" --layers "$2" \
          --coverage "$cov" --recorded "$trace" --trace-layers "$3" --pack-dir /tmp/rp "${reads[@]}" \
          --commit "$commit" --json "$work/timeline-$1-$cov.json"
      done
      stage "replay-waits-$1" 60 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" \
        --steps 240 --warmup 20 --coverages 0.5 --arena-gb 4 --arena-preload --dtype bfloat16 --no-synthetic \
        --trace "$trace" --trace-layers "$3" --trace-top-k trace --config pass_pair=0 --compare-config layer_waits=0 \
        --interleave --commit "$commit" --out "$work/replay_$1_waits.json"
    done
    ;;
  first21)  # config unwaited_first_pass (on by default since this step's tree): a decode step's first pass and the pass
    # pair without the pool's per-layer waits. The GPU tests of the first pass, the layer waits, the pair, the pass
    # gather, the runtime and the unread step; the main job on the quality checkpoint at a 25 % and a full pool; then
    # the default against unwaited_first_pass=0 on the recorded trace (both presets, 50 / 25 / 10 %, interleaved, 220
    # steady steps). Stage limits 150 + 2 x 45 + 75 + 95 s.
    stage tests 150 python3 -m pytest tests/test_runtime_first_pass.py tests/test_runtime_layer_waits.py \
      tests/test_runtime_pass_pair.py tests/test_runtime_pass_gather.py tests/test_runtime_gpu.py \
      tests/test_runtime_unread.py -m gpu -q
    main_job_both_pools 45
    recorded_compare first21 unwaited_first_pass=0
    ;;
  first21b)  # first21's code on the synthetic trace: the default against unwaited_first_pass=0, interleaved, 300
    # steady steps, qwen3-30b-a3b at 100 / 50 / 25 / 10 %, ds-v2-lite at 50 / 25 / 10 %. Stage limits 110 + 70 s.
    pair_compare first21 110 unwaited_first_pass=0 qwen3-30b-a3b 16 1,0.5,0.25,0.1 320 pass_pair=auto
    pair_compare first21 70 unwaited_first_pass=0 ds-v2-lite 8 0.5,0.25,0.1 320 pass_pair=auto
    ;;
  choice21)  # the pair's timed choice by expected time (ExpectedTimeChoice: each kind's times with and without a
    # first-pass miss, weighed by the share of recent first passes that missed) and spares staged only after a recent
    # miss, over first21's unwaited first passes: the GPU tests of the first pass, the choice, the pair and the layer
    # waits; the main job at a 25 % pool; then the default against single passes (pass_pair=0) on the recorded trace
    # (both presets, 50 / 25 / 10 %, 220 steady steps) and on the synthetic one (both presets, 50 / 25 / 10 %, 300
    # steady steps), interleaved. Stage limits 130 + 45 + 75 + 95 + 90 + 60 s.
    stage tests 130 python3 -m pytest tests/test_runtime_first_pass.py tests/test_runtime_pair_choice.py \
      tests/test_runtime_pass_pair.py tests/test_runtime_layer_waits.py -m gpu -q
    stage generate-quality 45 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    recorded_compare choice21 pass_pair=0
    pair_compare choice21 90 pass_pair=0 qwen3-30b-a3b 16 0.5,0.25,0.1 320 pass_pair=auto
    pair_compare choice21 60 pass_pair=0 ds-v2-lite 8 0.5,0.25,0.1 320 pass_pair=auto
    ;;
  choice21b)  # choice21 with the single passes no pair could replace feeding the choice's single no-miss and miss
    # times (ExpectedTimeChoice.observe): the default against single passes on the recorded trace (both presets, 50 /
    # 25 / 10 %, interleaved, 220 steady steps). Stage limits 75 + 95 s.
    recorded_compare choice21b pass_pair=0
    ;;
  head22)  # nineteenth session: the eighteenth's last code (the pair choice runs a kind that has no time for an outcome
    # the recent steps had; per-step first-pass misses in the replay JSON): the GPU tests of the first pass, the choice,
    # the pair, the layer waits, the pass gather, the runtime and the unread step; then, on the recorded trace (both
    # presets, 50 / 25 / 10 %, interleaved, 220 steady steps), the default against single passes (pass_pair=0) and
    # against passes that gather their own rows (gather_in_pass=1: no pairs, no replay for a miss the arena holds).
    # Stage limits 150 + 2 x (75 + 95) s.
    stage tests 150 python3 -m pytest tests/test_runtime_first_pass.py tests/test_runtime_pair_choice.py \
      tests/test_runtime_pass_pair.py tests/test_runtime_layer_waits.py tests/test_runtime_pass_gather.py \
      tests/test_runtime_gpu.py tests/test_runtime_unread.py -m gpu -q
    recorded_compare head22 pass_pair=0
    recorded_compare head22g gather_in_pass=1
    ;;
  skip22|skip22b|skip22c)  # config pass_pair_replay_segment: a pair's replay in conditional graph nodes of 4 MoE
    # layers, run only when its first pass missed (at these steps' commits the default; off since d011bc4).
    # skip22 (9400b58) found the H200's torch 2.11 without CUDAGraph.begin_capture_to_if_node (its captured replays
    # all ran); skip22b (1bcc0d4) had the CUDA runtime make the IF nodes (kernels/cuda/graph_if.cu) and failed to
    # capture (torch 2.11's CUDAGraph.pool() answers only after a capture); skip22c (437e4bc) gave the capture its pool
    # and ran the MoE layers' side work inside a body on a stream of its own. Stages: replay_segment_stages.
    replay_segment_stages "$step"
    ;;
  stream23)  # config stream_arena: a decode pass computes an expert without a slot from its pinned arena row (the
    # W2_STREAM builds of the single-token kernels), no replay; the rows it streamed installed after the read, unwaited.
    # The GPU tests of the stream kernels and the runtime, the route, the CUDA whole op and the runtime's GPU tests
    # (the route and the combine changed for every run); the main job at a 25 % pool; then stream_arena=1 against
    # the default on the recorded trace (both presets, 50 / 25 / 10 %, 220 steady steps), interleaved. Stage limits
    # 170 + 45 + 75 + 95 s.
    stage tests 170 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_route_kernel.py \
      tests/test_runtime_cuda_w2.py tests/test_runtime_gpu.py tests/test_cuda_w2_pair_order.py -m gpu -q
    stage generate-quality 45 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    recorded_compare "$step" stream_arena=1
    ;;
  stream23b)  # stream23's code on the synthetic trace: stream_arena=1 against the default, interleaved, 300 steady
    # steps, both presets at 50 / 25 / 10 %. Stage limits 90 + 60 s.
    pair_compare stream23 90 stream_arena=1 qwen3-30b-a3b 16 0.5,0.25,0.1 320 pass_pair=auto
    pair_compare stream23 60 stream_arena=1 ds-v2-lite 8 0.5,0.25,0.1 320 pass_pair=auto
    ;;
  stream23c)  # the stream builds with W2_STREAM_PREFETCH (a streamed pair's rows asked into L2 by bulk prefetches, the
    # runtime's default since stream23): the GPU tests of the stream kernels and the runtime; the kernels alone
    # (stream_kernels.py: 0 / 1 / 2 / 4 streamed experts per layer, with and without the prefetch, against the
    # resident layer and the copy engine); then stream_arena=1 against the default on the recorded trace, interleaved.
    # Stage limits 120 + 150 + 75 + 95 s.
    stage tests 120 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_route_kernel.py -m gpu -q
    stage stream-kernels 150 python3 benchmarks/stream_kernels.py --presets ds-v2-lite,qwen3-30b-a3b \
      --streamed 0,1,2,4 --commit "$commit" --json "$work/stream_kernels.json"
    recorded_compare "$step" stream_arena=1
    ;;
  stream24)  # stream_arena with its installs issued while the next step's first pass runs and only the hotter
    # streamed experts installed (config stream_install hotter; the floor counts streamed bytes, not their installs):
    # the GPU tests of the stream kernels and the runtime, the route, the CUDA whole op and the runtime's GPU tests; the
    # main job at a 25 % pool; then stream_arena=1 (the base run, its own floor) against the default (stream_arena=0)
    # on the recorded trace, interleaved. Stage limits 170 + 45 + 75 + 95 s.
    stage tests 170 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_route_kernel.py \
      tests/test_runtime_cuda_w2.py tests/test_runtime_gpu.py -m gpu -q
    stage generate-quality 45 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    recorded_compare "$step" stream_arena=0 stream_arena=1
    ;;
  stream24b)  # stream24's code: stream_install hotter (base) against all on the recorded trace, then stream_arena=1
    # (base) against the default on the synthetic trace (both presets at 50 / 25 / 10 %, 300 steady steps), interleaved.
    # Stage limits 75 + 95 + 90 + 60 s.
    recorded_compare "$step" stream_install=all stream_arena=1
    pair_compare "$step" 90 stream_arena=0 qwen3-30b-a3b 16 0.5,0.25,0.1 320 stream_arena=1
    pair_compare "$step" 60 stream_arena=0 ds-v2-lite 8 0.5,0.25,0.1 320 stream_arena=1
    ;;
  stream24c)  # stream24 / stream24b again after the plain resident step's sync became its own stream's (before, a
    # device-wide sync also waited for the unwaited installs another interleaved runtime had in flight, which raised
    # the floor's resident step: 0.445 ms against 0.209 at ds-v2-lite 10 % in stream24b, beside stream_install all):
    # stream_arena=1 against the default and hotter against all on the recorded trace, then stream_arena=1 against
    # the default on the synthetic one. Stage limits 75 + 95 + 75 + 95 + 90 + 60 s.
    recorded_compare "$step" stream_arena=0 stream_arena=1
    recorded_compare "${step}all" stream_install=all stream_arena=1
    pair_compare "$step" 90 stream_arena=0 qwen3-30b-a3b 16 0.5,0.25,0.1 320 stream_arena=1
    pair_compare "$step" 60 stream_arena=0 ds-v2-lite 8 0.5,0.25,0.1 320 stream_arena=1
    ;;
  stream24d)  # stream24c's code, each run alone (not interleaved: an interleaved runtime's unwaited installs run on into
    # the next runtime's step, so two streaming configs, or a streaming one and the default, share the bus there; a
    # decoder has one runtime): stream_arena=1 (base, its own floor) against the default on the recorded trace in
    # both orders (the compared run after the base run, then before it: --compare-first), then on the synthetic
    # trace (300 steady steps). Stage limits 75 + 95 + 75 + 95 + 90 + 60 s.
    for order in after first; do
      for cell in "ds-v2-lite 8 first 75" "qwen3-30b-a3b 16 tile 95"; do
        set -- $cell
        first=()
        [ "$order" = first ] && first=(--compare-first)
        stage "replay-$step-recorded-$1-$order" "$4" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" \
          --layers "$2" --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
          --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers "$3" \
          --trace-top-k trace --config stream_arena=1 --compare-config stream_arena=0 ${first[@]+"${first[@]}"} \
          --commit "$commit" --out "$work/replay_$1_${step}_recorded_$order.json"
      done
    done
    for cell in "qwen3-30b-a3b 16 90" "ds-v2-lite 8 60"; do
      set -- $cell
      stage "replay-$step-$1" "$3" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" \
        --steps 320 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --config stream_arena=1 --compare-config stream_arena=0 --commit "$commit" --out "$work/replay_$1_$step.json"
    done
    ;;
  stream24e)  # stream_arena auto (the default since this step's commit: on where the CUDA kernels run with an arena of
    # every expert): the main job at a 25 % pool, then the GPU tests of the stream runtime (auto on bfloat16 streams,
    # float32 misses; true, eager and in graphs). Stage limits 45 + 120 s.
    stage generate-quality 45 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    stage tests 120 python3 -m pytest tests/test_runtime_stream_arena.py -m gpu -q -k "streams_and_equals or auto_streams"
    ;;
  triton25)  # the Triton stages stream (moe_mm stream=True; stream_arena auto on wherever the triton backend runs on
    # CUDA with an arena of every expert) and `tierstore generate`'s auto arena holds the whole pack where half the
    # host's available memory takes it: the kernel and runtime GPU tests, the main job with the new defaults (hidden 256:
    # the Triton stages stream) and with the old default's quarter arena (no streaming), then ds-v2-lite on the
    # Triton kernels (cuda_w2=0), streaming against not, recorded and synthetic traces. Limits 20 + 170 + 50 + 50 +
    # 130 + 110 s.
    stage psutil 20 python3 -c "import psutil; print(psutil.__version__, psutil.virtual_memory().available)"
    stage tests 170 bash -c "python3 -m pytest tests/test_kernels_stream.py tests/test_kernels_moe.py -q -x && \
      python3 -m pytest tests/test_runtime_stream_arena.py tests/test_runtime_cuda_w2.py -m gpu -q -x"
    stage generate-quality 50 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    stage generate-quality-quarter-arena 50 tierstore generate benchmarks/quality/checkpoint \
      --prompt "def read_config(path):" --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident --arena-gb 0.0032
    stage replay-$step-recorded-ds-v2-lite 130 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite \
      --layers 8 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first --trace-top-k trace \
      --config cuda_w2=0 --config stream_arena=1 --compare-config stream_arena=0 --commit "$commit" \
      --out "$work/replay_ds-v2-lite_${step}_recorded.json"
    stage replay-$step-ds-v2-lite 110 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --config cuda_w2=0 --config stream_arena=1 --compare-config stream_arena=0 --commit "$commit" \
      --out "$work/replay_ds-v2-lite_$step.json"
    ;;
  triton25b)  # triton25's GPU tests after the fix of its stream-path assertion (the CUDA op is built at boot and
    # serves only bfloat16 passes), the pass pair's GPU tests (conditional replay segments included, not run since
    # they landed), and the runtime's GPU tests. Limits 240 + 240 s.
    stage tests-stream 240 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_runtime_cuda_w2.py \
      tests/test_runtime_pass_pair.py -m gpu -q
    runtime_gpu_tests 240
    ;;
  triton25c)  # triton25b's failures mended (tests of the miss path over an arena of every expert now turn streaming
    # off; pass_pair auto's case list gains stream_arena's), with the first pass's GPU tests, then qwen3-30b-a3b on the
    # Triton kernels, streaming against not, on the recorded trace. Limits 240 + 170 s.
    stage tests 240 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_layer_waits.py \
      tests/test_runtime_first_pass.py tests/test_runtime_stream_arena.py -m gpu -q
    stage replay-$step-recorded-qwen3-30b-a3b 170 python3 benchmarks/replay.py --pack-dir /tmp/rp \
      --presets qwen3-30b-a3b --layers 16 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 \
      --arena-preload --dtype bfloat16 --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz \
      --trace-layers tile --trace-top-k trace --config cuda_w2=0 --config stream_arena=1 \
      --compare-config stream_arena=0 --commit "$commit" --out "$work/replay_qwen3-30b-a3b_${step}_recorded.json"
    ;;
  triton25d)  # triton25's comparisons again: the main job with the auto arena and with the old quarter arena, twice
    # in alternated order; ds-v2-lite on the Triton kernels on the recorded trace with the compared run first
    # (--compare-first); qwen3-30b-a3b on the Triton kernels on the synthetic trace. Limits 4 x 45 + 130 + 150 s.
    for round in 1 2; do
      arenas=(auto 0.0032)
      [ "$round" = 2 ] && arenas=(0.0032 auto)
      for arena in "${arenas[@]}"; do
        stage "generate-quality-$arena-$round" 45 tierstore generate benchmarks/quality/checkpoint \
          --prompt "def read_config(path):" --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident --arena-gb "$arena"
      done
    done
    stage replay-$step-recorded-ds-v2-lite 130 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite \
      --layers 8 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first --trace-top-k trace \
      --config cuda_w2=0 --config stream_arena=1 --compare-config stream_arena=0 --compare-first --commit "$commit" \
      --out "$work/replay_ds-v2-lite_${step}_recorded.json"
    stage replay-$step-qwen3-30b-a3b 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
      --layers 16 --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --config cuda_w2=0 --config stream_arena=1 --compare-config stream_arena=0 --commit "$commit" \
      --out "$work/replay_qwen3-30b-a3b_$step.json"
    ;;
  quiet26)  # twenty-third session: where a streaming step that streams nothing (ds-v2-lite 50 %, the recorded trace,
    # the CUDA kernels, the default config) spends more than the resident decoder: the event clock and the profiler
    # (miss_step_timeline.py --recorded) at 50 % and at a full pool that reads every pass. Limits 2 x 100 s.
    trace=benchmarks/traces/generate-quality-checkpoint.npz
    for cov in 0.5 1; do
      reads=()
      [ "$cov" = 1 ] && reads=(--full-pool-reads)
      stage "timeline-ds-v2-lite-$cov" 100 python3 benchmarks/miss_step_timeline.py --preset ds-v2-lite --layers 8 \
        --coverage "$cov" --recorded "$trace" --trace-layers first --pack-dir /tmp/rp "${reads[@]}" \
        --commit "$commit" --json "$work/timeline-ds-v2-lite-$cov.json"
    done
    ;;
  quiet26b)  # twenty-third session: the host time of the step protocol's functions, per step kind (step_host_profile.py,
    # wrapped clock then cProfile), ds-v2-lite on the recorded trace at 50 % (the default config: streaming) and at a
    # full pool that reads every pass. Limits 2 x 100 s.
    trace=benchmarks/traces/generate-quality-checkpoint.npz
    for cov in 0.5 1; do
      reads=()
      [ "$cov" = 1 ] && reads=(--config full_pool_reads=1)
      stage "host-ds-v2-lite-$cov" 100 python3 benchmarks/step_host_profile.py --preset ds-v2-lite --layers 8 \
        --coverage "$cov" --recorded "$trace" --trace-layers first --pack-dir /tmp/rp "${reads[@]}" \
        --commit "$commit" --json "$work/host-ds-v2-lite-$cov.json"
    done
    ;;
  quiet26c|quiet26d)  # twenty-third session, after 3cc52d4 (quiet26c: no victim plan or early hits while a streaming pass
    # cannot miss) and its mend (quiet26d: the early hits kept, applied behind the pass, not batched into an install): the
    # host profile at 50 % again, then ds-v2-lite on the recorded trace, the default config (CUDA kernels, streaming)
    # against stream_arena=0 in one process, in both orders (stream24d's cells). Limits 100 + 2 x 140 s.
    trace=benchmarks/traces/generate-quality-checkpoint.npz
    stage host-ds-v2-lite-0.5 100 python3 benchmarks/step_host_profile.py --preset ds-v2-lite --layers 8 \
      --coverage 0.5 --recorded "$trace" --trace-layers first --pack-dir /tmp/rp --commit "$commit" \
      --json "$work/host-ds-v2-lite-0.5.json"
    ds_recorded_orders
    if [ "$step" = quiet26d ]; then  # and the stream GPU tests and the main job at this code (limits 240 + 60 s)
      stage stream-tests 240 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_kernels_stream.py -m gpu -q
      stage generate-quality 60 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
        --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    fi
    ;;
  quiet26e)  # twenty-third session, quiet26d's code: the default config (CUDA kernels, streaming) against stream_arena=0
    # in one process, the rest of stream24d's cells: qwen3-30b-a3b on the recorded trace in both orders, then both
    # presets on the synthetic trace (300 steady steps). Stage limits 2 x 95 + 90 + 60 s.
    for order in after first; do
      first=()
      [ "$order" = first ] && first=(--compare-first)
      stage "replay-$step-recorded-qwen3-30b-a3b-$order" 95 python3 benchmarks/replay.py --pack-dir /tmp/rp \
        --presets qwen3-30b-a3b --layers 16 --steps 240 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 \
        --arena-preload --dtype bfloat16 --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz \
        --trace-layers tile --trace-top-k trace --compare-config stream_arena=0 ${first[@]+"${first[@]}"} \
        --commit "$commit" --out "$work/replay_qwen3-30b-a3b_${step}-recorded-$order.json"
    done
    for cell in "qwen3-30b-a3b 16 90" "ds-v2-lite 8 60"; do
      set -- $cell
      stage "replay-$step-$1" "$3" python3 benchmarks/replay.py --pack-dir /tmp/rp --presets "$1" --layers "$2" \
        --steps 320 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
        --compare-config stream_arena=0 --commit "$commit" --out "$work/replay_$1_$step.json"
    done
    ;;
  quiet26f)  # twenty-third session, final code: the runtime's GPU tests (pool, layer waits, early fetch, cuda_w2, located
    # fetch, fetch split) and those of the pass pair, first pass and streaming, then ds-v2-lite on the recorded trace
    # again in both orders (quiet26d's cells, two more processes), after the host profile with the install's parts
    # wrapped (100 steps per clock). Limits 240 + 240 + 100 + 2 x 140 s.
    runtime_gpu_tests 240
    stage tests-stream 240 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_first_pass.py \
      tests/test_runtime_stream_arena.py -m gpu -q
    stage host-ds-v2-lite-0.5 100 python3 benchmarks/step_host_profile.py --preset ds-v2-lite --layers 8 \
      --coverage 0.5 --recorded benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first \
      --pack-dir /tmp/rp --steps 100 --warm-steps 30 --commit "$commit" --json "$work/host-ds-v2-lite-0.5.json"
    ds_recorded_orders
    ;;
  ops27|ops27b)  # twenty-fourth session (ops27 at aba1411, with the event query and elapsed time through the driver
    # too; ops27b at the final code): the located install's stream ordering through the driver (StreamOps) and its map
    # on arrays: the per-call cost of torch's form against the driver's, the runtime's GPU tests and those of the pass
    # pair, first pass, streaming and StreamOps, the host profile (install parts wrapped) and ds-v2-lite's recorded
    # cells in both orders; ops27b also the main job (limit 60 s). Limits 60 + 200 + 200 + 100 + 2 x 140 s (ops27 took
    # 256 s in all).
    stage ops-cost 60 python3 benchmarks/stream_ops_cost.py --commit "$commit" --json "$work/ops-cost.json"
    runtime_gpu_tests 200
    stage tests-stream 200 python3 -m pytest tests/test_runtime_pass_pair.py tests/test_runtime_first_pass.py \
      tests/test_runtime_stream_arena.py tests/test_runtime_stream_ops.py -m gpu -q
    stage host-ds-v2-lite-0.5 100 python3 benchmarks/step_host_profile.py --preset ds-v2-lite --layers 8 \
      --coverage 0.5 --recorded benchmarks/traces/generate-quality-checkpoint.npz --trace-layers first \
      --pack-dir /tmp/rp --steps 100 --warm-steps 30 --commit "$commit" --json "$work/host-ds-v2-lite-0.5.json"
    ds_recorded_orders
    if [ "$step" = ops27b ]; then
      stage generate-quality 60 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
        --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    fi
    ;;
  matrix28|matrix28b)  # twenty-fifth session: issue #5's whole benchmark matrix again at the current code (last run in
    # full at 54fb697 / 9fc5316), default config, separate runs (resident, resident readback, tiered, naive), bf16, the
    # floor's disk rate the faster of the warm best-of-4 probe and the run's own reads (f93c96a). matrix28: ds-v2-lite
    # (8 layers) synthetic and recorded, each with the 4 GiB arena preloaded and with none, at 100 / 50 / 25 / 10 %,
    # then qwen3-30b-a3b (16 layers) synthetic preloaded; matrix28b: qwen3-30b-a3b synthetic with no arena and the
    # recorded trace (layers tiled) with both arenas. Limits 230 + 160 + 150 = 540 s and 300 + 240 = 540 s; estimates
    # from 54fb697's summaries (matrix, recorded: 80 + 92 + 47 + 45 + 143 s) and 9fc5316's qwen3none logs.
    if [ "$step" = matrix28 ]; then
      matrix_cells 4,0
    else
      stage replay-syn-qwen3-none 300 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b \
        --layers 16 --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 0 --dtype bfloat16 \
        --commit "$commit" --out "$work/replay_qwen3-30b-a3b_synthetic-none_$step.json"
      stage replay-rec-qwen3 240 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
        --steps 240 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4,0 --arena-preload --dtype bfloat16 \
        --no-synthetic --trace benchmarks/traces/generate-quality-checkpoint.npz --trace-layers tile \
        --trace-top-k trace --commit "$commit" --out "$work/replay_qwen3-30b-a3b_recorded_$step.json"
    fi
    ;;
  host28)  # twenty-fifth session: where a streaming step's host time goes on the synthetic trace (step_host_profile.py,
    # skewed trace, 4 GiB arena preloaded, bf16, graphs), ds-v2-lite at 25 / 10 / 50 % and qwen3-30b-a3b at 25 %, where
    # matrix28's streaming cells sat at 1.25x-1.29x their floor. Limits 4 x 100 s.
    for cell in "ds-v2-lite 8 0.25" "ds-v2-lite 8 0.1" "ds-v2-lite 8 0.5" "qwen3-30b-a3b 16 0.25"; do
      set -- $cell
      stage "host-$1-$3" 100 python3 benchmarks/step_host_profile.py --preset "$1" --layers "$2" --coverage "$3" \
        --pack-dir /tmp/rp --steps 100 --warm-steps 30 --commit "$commit" --json "$work/host-$1-$3.json"
    done
    ;;
  matrix28c)  # twenty-fifth session: matrix28's cells with the arena again (a second process each, for their spread;
    # ds-v2-lite synthetic sat at 1.254x / 1.286x / 1.257x), ds-v2-lite synthetic beside stream_heat_halving=512 (the
    # heat's memory 4x longer, in the same process, after the default run). Limits 230 + 160 + 150 s.
    matrix_cells 4 --compare-config stream_heat_halving=512
    ;;
  mend29)  # twenty-sixth session, first call (~4 min of device time left): the GPU tests of the review mend 52f767d
    # (_Driver.retry_in_context shared by HostToDevice.copy and StreamOps.record / wait): the stream ops, the pool's
    # copies and the located fetch on CUDA. Limit 120 s.
    stage tests 120 python3 -m pytest tests/test_runtime_stream_ops.py tests/test_runtime_pool_copies.py \
      tests/test_runtime_located_fetch.py tests/test_driver_retry.py -m "gpu or not gpu" -q -x
    ;;
  next29)  # for the next session's first call: the GPU tests of the arena's address array (140d771: StreamRows.refresh
    # and PassGather's address sync read Arena.address_array), the streaming and gathering runtime on CUDA, then the
    # main job (its auto arena fills while it streams). Limits 240 + 90 s.
    stage tests 240 python3 -m pytest tests/test_arena_address_tables.py tests/test_runtime_stream_arena.py \
      tests/test_runtime_pass_gather.py tests/test_kernels_stream.py -m "gpu or not gpu" -q
    stage generate-quality 90 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  bus30)  # twenty-seventh session, first call: next29's GPU tests and main job, then what a streamed expert's read
    # pattern gets over the bus (benchmarks/w2_access.py --memory host: the gate_up's row pattern, the paired one whose
    # every load covers a row's whole 128-byte tile, both with and without the L2 bulk prefetch, the contiguous
    # chunk, against the copy engine's H2D copy of the same bytes) at ds-v2-lite's and qwen3-30b-a3b's shapes, and the
    # paired pattern's cost in device memory. Limits 240 + 90 + 3 x 90 s. Estimates, not measured: the probes ~30-60 s
    # each (ten builds first, then cached).
    stage tests 240 python3 -m pytest tests/test_arena_address_tables.py tests/test_runtime_stream_arena.py \
      tests/test_runtime_pass_gather.py tests/test_kernels_stream.py -m "gpu or not gpu" -q
    stage generate-quality 90 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    for shape in "ds-v2-lite 1408" "qwen3-30b-a3b 768"; do
      set -- $shape
      stage "bus-$1" 90 python3 benchmarks/w2_access.py --memory host --hidden 2048 --inter "$2" --experts 1,4,8 \
        --sets 16 --patterns rows,paired,rows_prefetch,paired_prefetch,contiguous --ahead 1,2 --commit "$commit" \
        --json "$work/bus-reads-$1.json"
    done
    stage hbm-ds-v2-lite 90 python3 benchmarks/w2_access.py --memory device --hidden 2048 --inter 1408 --experts 6 \
      --sets 16 --patterns rows,paired --ahead 1,2 --commit "$commit" --json "$work/hbm-reads-ds-v2-lite.json"
    ;;
  stage30)  # twenty-seventh session: W2_STREAM_STAGE (a streamed block's rows copied into shared memory in contiguous
    # runs first, bus30's contiguous pattern): its GPU tests (the stream builds against the resident kernels, staged
    # and given no room; the SASS of the builds without it unchanged), the kernels alone (stream_kernels.py: resident,
    # stream, prefetch, stage, the stage build with nothing streamed, h2d), then the synthetic arena cells of both
    # presets, the default against stream_stage=1 in one process. Limits 130 + 100 + 190 + 150 s.
    stage tests 130 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_cuda_w2.py -m "gpu or not gpu" -q \
      -k "stream or sass"
    stage stream-kernels 100 python3 benchmarks/stream_kernels.py --presets ds-v2-lite,qwen3-30b-a3b --streamed 0,1,2,4 \
      --commit "$commit" --json "$work/stream-kernels.json"
    stage replay-syn-ds 190 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets ds-v2-lite --layers 8 \
      --steps 220 --warmup 20 --coverages 1,0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config stream_stage=1 --commit "$commit" --out "$work/replay_ds-v2-lite_synthetic_$step.json"
    stage replay-syn-qwen3 150 python3 benchmarks/replay.py --pack-dir /tmp/rp --presets qwen3-30b-a3b --layers 16 \
      --steps 220 --warmup 20 --coverages 0.5,0.25,0.1 --arena-gb 4 --arena-preload --dtype bfloat16 \
      --compare-config stream_stage=1 --commit "$commit" --out "$work/replay_qwen3-30b-a3b_synthetic_$step.json"
    ;;
  stage30b)  # twenty-seventh session: stage30 found the down's staged words one vector off per lane (the down passes
    # its lane's word vector to the loads: mended), and the stage 15-18 % faster at ds-v2-lite synthetic with wrong
    # tokens; so again: the GPU tests, the kernels alone, then issue #5's arena cells (ds-v2-lite synthetic and
    # recorded, qwen3-30b-a3b synthetic and recorded, 4 GiB preloaded) at the new default (stream_stage on) against
    # stream_stage=0 in one process. Limits 100 + 80 + 100 + 100 + 90 + 110 s.
    stage tests 100 python3 -m pytest tests/test_runtime_stream_arena.py -m gpu -q -k "stream_builds or cuda"
    stage stream-kernels 80 python3 benchmarks/stream_kernels.py --presets ds-v2-lite,qwen3-30b-a3b --streamed 0,1,2,4 \
      --rounds 3 --commit "$commit" --json "$work/stream-kernels.json"
    stage_arena_cells 100 100 90 110
    ;;
  stage30c)  # twenty-eighth session: stage30b's stage build cost the layers that stream nothing ~2 us each (max
    # carveout); now the carveout that just fits 4 blocks (the default at f180fd0) against the largest, side by side in
    # stream_kernels.py; the stream builds' GPU tests (stage, the SASS of the other builds) and the main job; then
    # issue #5's arena cells again at this commit's default against stream_stage=0 in one process.
    # Limits 90 + 60 + 70 + 90 + 90 + 90 + 100 s (stage30b's took 58 / 18 / 57 / 49 / 73 / 68 s).
    stage30_checks_and_cells
    ;;
  stage30d)  # twenty-eighth session: stage30c's "fit" carveout cost the layers that stream nothing more than "max"
    # (3.5 vs 2.0 us at ds-v2-lite): "max" is the default again; stream_kernels.py adds the plain build asking the
    # largest carveout (whether the carveout or the stage build costs those layers); the GPU tests, the main job and
    # issue #5's arena cells at this default against stream_stage=0 in one process. Limits as stage30c's.
    stage30_checks_and_cells
    ;;
  policy31)  # twenty-ninth session, first call: the base pool's policy freq-dense (freq's order over arrays) against
    # the default lru, in one process per workload, in issue #5's cells without an arena (disk-bound: the pool's misses
    # are the disk's reads), then the main job with freq-dense. Limits 150 + 80 + 170 + 80 + 70 s.
    policy_cells 0 150 80 170 80
    stage generate-quality 70 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --policy freq-dense --verify-resident
    ;;
  policy31b)  # twenty-ninth session: the same comparison in issue #5's cells with the 4 GiB arena preloaded (the
    # pool's misses stream from the arena; the policy's host time is on a short step). Limits 90 + 90 + 100 + 100 s.
    policy_cells 4 90 90 100 100
    ;;
  policy31c)  # twenty-ninth session: freq-dense the default now (its first victims from a cheaper sort than at
    # policy31's 2ad7fd2, the same order): the runtime's GPU tests, the stream arena's, and the main job at this default
    runtime_gpu_tests 240
    stage tests-stream 120 python3 -m pytest tests/test_runtime_stream_arena.py tests/test_runtime_pass_gather.py -m gpu -q
    stage generate-quality 70 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  reads32)  # thirtieth session: a step's few pack rows (1 / 2 / 4) read into pinned against pageable memory, through
    # PackRows (since 4e28267 the last row's checksum where it was read), every checksum handed to a verification
    # thread (PackRows before), checksums inline, or raw, back to back or after a 3 ms idle gap
    # (benchmarks/read_destinations.py; every row read once), ds-v2-lite (26 layers) and qwen3-30b-a3b (16); then the
    # recorded-trace cells without an arena (recorded_none_cells). Limits 150 + 150 + 80 + 80 s.
    stage reads-ds 150 python3 benchmarks/read_destinations.py --preset ds-v2-lite --pack-dir /tmp/rd \
      --commit "$commit" --json "$work/read-destinations-ds-v2-lite.json"
    stage reads-qwen3 150 python3 benchmarks/read_destinations.py --preset qwen3-30b-a3b --layers 16 --pack-dir /tmp/rd \
      --commit "$commit" --json "$work/read-destinations-qwen3-30b-a3b.json"
    recorded_none_cells 80 80
    ;;
  reads32b)  # thirtieth session: the same reads, pinned only, through the arena's staging (the runtime's path), through
    # PackRows, or raw, with nothing, a 3 ms sleep or ~3 ms of GPU matrix products and a stream synchronisation before
    # each batch (as a step's pass-log read before its fetch); ds-v2-lite (26 layers), qwen3-30b-a3b (16).
    # Limits 150 + 150 s.
    stage reads-ds 150 python3 benchmarks/read_destinations.py --preset ds-v2-lite --pack-dir /tmp/rd \
      --destinations pinned --paths arena,checked,raw --before none,sleep,gpu \
      --commit "$commit" --json "$work/read-before-ds-v2-lite.json"
    stage reads-qwen3 150 python3 benchmarks/read_destinations.py --preset qwen3-30b-a3b --layers 16 --pack-dir /tmp/rd \
      --destinations pinned --paths arena,checked,raw --before none,sleep,gpu \
      --commit "$commit" --json "$work/read-before-qwen3-30b-a3b.json"
    ;;
  profile32)  # thirtieth session: where a step's host time goes without an arena (benchmarks/step_host_profile.py
    # --arena-gb 0, the arena's fetch, PackRows and the reader wrapped too), recorded trace: ds-v2-lite at 25 / 50 %,
    # qwen3-30b-a3b at 10 % (layers tiled). Limits 100 + 100 + 120 s.
    none_profiles
    ;;
  next33)  # for the next session: profile32's no-arena host profiles, then the few-row reads in a random order each
    # round (pinned; the arena's path, PackRows, raw; nothing before), ds-v2-lite. Limits 100 + 100 + 120 + 100 s.
    none_profiles
    stage reads-ds 100 python3 benchmarks/read_destinations.py --preset ds-v2-lite --pack-dir /tmp/rd \
      --destinations pinned --paths arena,checked,raw --before none --commit "$commit" \
      --json "$work/read-shuffled-ds-v2-lite.json"
    ;;
  next33b)  # for the next session: freq-dense's kept order on the H200's host (benchmarks/policy_order_cost.py, against
    # lru), the runtime's GPU tests and the main job at this default. Limits 120 + 240 + 70 s.
    stage policy-cost 120 python3 benchmarks/policy_order_cost.py --json "$work/policy-order-cost-h200.json"
    runtime_gpu_tests 240
    stage generate-quality 70 tierstore generate benchmarks/quality/checkpoint --prompt "def read_config(path):" \
      --max-new-tokens 48 --gpu-pool-frac 0.25 --verify-resident
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac

python3 - "$work" "$commit" <<'EOF'
import json, pathlib, sys
work, commit = pathlib.Path(sys.argv[1]), sys.argv[2]
for path in sorted(work.glob("*.json")):
    data = json.loads(path.read_text())
    provenance = data.get("provenance") if isinstance(data, dict) else None
    if isinstance(provenance, dict) and provenance.get("commit") != commit:
        provenance["commit_seen"], provenance["commit"] = provenance.get("commit"), commit
        path.write_text(json.dumps(data, indent=1) + "\n")
EOF
tail -n 3 "$work"/*.log
cat "$work/summary.txt"
tar -C "$out" -czf "$out/$step.tar.gz" "$step" && rm -rf "$work"
