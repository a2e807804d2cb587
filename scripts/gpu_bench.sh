#!/usr/bin/env bash
# GPU benchmarks and parity on one machine: statecut (built with --features cuda) against the
# PyTorch + fla / transformers pipeline, on random-weight checkpoints of the real sizes.
#
#   scripts/gpu_bench.sh BUNDLE OUT STAGE...
#
# BUNDLE holds statecut.xz (release binary), gpu_parity.xz (the CUDA parity test binary),
# recurrence.xz (the recurrence bench binary),
# whl/ (fla wheels), tokenizer/ (tokenizer files for the random checkpoints), shared/ (reference
# models and data/calib/wiki.jsonl). Every stage writes its
# log and JSON under OUT as it finishes. Stages:
#   parity                the CUDA parity tests on the reference models present in BUNDLE/shared
#   ceiling               bf16 matmul rate of the GPU (torch), the forward's roofline
#   make:NAME             random checkpoint NAME (scripts/make_random_checkpoints.py)
#   statecut:NAME         statecut prune --method drrqr --ratio 0.5 on 128 x 2048 tokens (stage times
#                         in the report), peak GPU memory from nvidia-smi
#   reference:NAME        scripts/reference_pipeline.py on the same tokens
#   decode:NAME           decode ms/step, original vs statecut-pruned, with the library's kernels
#   bench:NAME            statecut bench, original vs pruned (--compare)
#   speed:NAME            the decode-speed table: statecut bench (100 steps per round; its step
#                         replayed from a CUDA graph) original vs pruned at 0.5 and at 0.75, and
#                         with EAGER=1 also at 0.5 launched op by op; then fla's decode captured in CUDA graphs
#                         (scripts/decode_bench.py --graphs: 10 warm-up, 100 timed steps, median of
#                         3 rounds) on the same three checkpoints
#   state:NAME            the recurrent-state update of a decode step alone, fla's fused recurrent
#                         kernels, original vs pruned (scripts/state_step_bench.py)
#   kernels:NAME          statecut eval throughput with the fused kernel vs the chunked recurrence
#   profile:NAME          where statecut's calibration pass spends its time (STATECUT_PROFILE=1)
#   calib:NAME            calibration before and after a change, in one call: for statecut and, when
#                         BUNDLE holds statecut_before.xz (another build), for it too, taking turns:
#                         the profile of 32 x 2048 tokens, then prune's stage times for 128 x 2048
#                         tokens; logs and stage seconds as calib_{profile,full}_{after,before}_NAME.*
#                         CALIB_KINDS narrows the runs (profile, full); CALIB_BATCH=N adds a full run
#                         of statecut with --batch-size N (calib_full_after_bN_NAME.*)
#   jit:NAME              where a pass's fixed cost goes: candle's own kernels are PTX, which the
#                         driver compiles when a process first loads them unless its compute cache
#                         holds them; the profile of 8 x 2048 tokens with the cache off, then cold and
#                         warm in a fresh cache folder, each with its wall time and stage seconds
#                         (JIT_RUNS picks among off, cold, warm and default: the driver's own folder)
#   stream:NAME           statecut prune resident, then layer-streamed under --max-device-memory
#                         $BUDGET (default 4GiB): wall time, peak GPU memory, and whether both kept
#                         the same channels
#   streamonly:NAME       statecut prune layer-streamed (--offload) only, for checkpoints larger
#                         than the GPU: wall time, peak GPU memory, per-stage seconds
#   passkey:NAME          statecut eval --task passkey at 2K and 4K tokens, original vs pruned: accuracy
#                         per depth, wall time, peak GPU memory
#   grad:NAME             statecut prune --method grad --ratio 0.5 (gradients of the LM loss through the
#                         backward pass) on GRAD_SAMPLES x 2048 tokens (default 128, several counts with
#                         spaces; GRAD_BATCH sets --batch-size): wall time, peak GPU memory, stage seconds
#   mixer:SHAPE/DECAY     the recurrence alone at SHAPE = B,T,H,DK,DV with DECAY none|head|channel,
#                         forward and forward + backward: statecut's forms (BUNDLE/recurrence.xz, built
#                         from benches/recurrence.rs; FORMS=a,b picks them) and fla's chunk kernels
#                         (scripts/recurrence_reference.py; FLA=0 skips them)
#   eager:MODEL           statecut bench --eager (prefill and op-by-op decode, bf16) on MODEL, a
#                         directory of the checkout (a fixture) or a random checkpoint NAME, with
#                         BUNDLE/statecut_before.xz and this build taking turns (EAGER_ROUNDS rounds
#                         each, default 3): eager_{before,after}_N_*.json and a summary of medians
#   BEFORE=1              grad:NAME and recover:NAME also run BUNDLE/statecut_before.xz, after this build
#   recover:NAME          recovery fine-tuning of NAME pruned at 0.5 (drrqr, 8 calibration sequences) from
#                         the unpruned NAME, RECOVER_STEPS steps (default 6) of RECOVER_BATCH x 2048 tokens
#                         (default 16): statecut recover, then the recipe in PyTorch + PEFT
#                         (scripts/recover_reference.py, 2 untimed warm-up steps) with fla's kernels and,
#                         when those fail (fla 0.6.0 refuses its gated backward on Hopper with Triton
#                         < 3.7.1), with the plain-PyTorch delta rule and its self-test against fla:
#                         tokens/s, peak GPU memory, per-step losses; RECOVER_REFERENCE=0 skips the
#                         reference (models whose two PyTorch copies do not fit); RECOVER_ARGS adds flags
# PRUNE_SAMPLES sets the calibration sequences of the pruned copies the decode stages time
# (default 128); GRAPHS=0 skips the CUDA-graph run of speed:NAME.
# MAKE_ARGS adds arguments to make_random_checkpoints.py (e.g. "--set num_hidden_layers=8");
# NSAMPLES sets the calibration sequences of the stream stages (default 128).
set -u
BUNDLE=$1; DEST=$2; shift 2
# Logs and JSON go to a work folder packed into DEST/results.tgz after every stage, so a run cut
# short still returns what it finished.
OUT=/tmp/gpu_bench_results
mkdir -p "$OUT" "$DEST"
export PYTHONUNBUFFERED=1
CK=/tmp/ck
mkdir -p $CK
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$BUNDLE"/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$LIBS:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for b in statecut statecut_before gpu_parity recurrence; do
  [ -f "$BUNDLE/$b.xz" ] && xz -dc "$BUNDLE/$b.xz" > /tmp/$b && chmod +x /tmp/$b
done
SC=/tmp/statecut
DATA=$BUNDLE/shared/data/calib/wiki.jsonl
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1

# Peak GPU memory of a command (MiB used on the card, sampled every 100 ms, minus the idle level).
peak() {
  local log=$1; shift
  local idle; idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > /tmp/mem.log &
  local pid=$!
  local t0; t0=$(date +%s.%N)
  "$@" > "$log" 2>&1
  local rc=$?
  local t1; t1=$(date +%s.%N)
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  local max; max=$(sort -n /tmp/mem.log | tail -1)
  echo "{\"rc\": $rc, \"wall_s\": $(awk "BEGIN{print $t1 - $t0}"), \"peak_mib\": $((max - idle)), \"idle_mib\": $idle}"
}

# A stage that needs checkpoint NAME (or its statecut-pruned copy) makes it first when an earlier
# call's machine, which held it, is gone.
ensure() {
  [ -d $CK/$1 ] || python3 scripts/make_random_checkpoints.py $CK --models "$1" --tokenizer-from "$BUNDLE/tokenizer" \
    ${MAKE_ARGS:-} > "$OUT/make_$1.log" 2>&1
  if [ "${2:-}" = pruned ] && [ ! -d $CK/$1-statecut ]; then
    $SC prune -m $CK/$1 --method drrqr --ratio 0.5 --calib "$DATA" --nsamples ${PRUNE_SAMPLES:-128} --seqlen 2048 --device cuda \
      --dtype bf16 -q -o $CK/$1-statecut > /dev/null 2>&1
  fi
}

for stage in "$@"; do
  name=${stage#*:}
  case $stage in
    eager:*) [ -d "$name" ] || ensure "$name" ;;
    statecut:*|reference:*|kernels:*|profile:*|calib:*|jit:*|stream:*|streamonly:*|grad:*|recover:*) ensure "$name" ;;
    decode:*|bench:*|state:*|passkey:*|speed:*) ensure "$name" pruned ;;
  esac
  echo "=== $stage ($(date +%T))"
  case $stage in
    parity)
      STATECUT_TEST_DATA=$BUNDLE/shared /tmp/gpu_parity --test-threads 1 --nocapture ${PARITY_FILTER:-} > "$OUT/parity.log" 2>&1
      echo "parity rc $?"; grep -E "relative error|match|test result|panicked" "$OUT/parity.log"
      # A test without its reference data passes as SKIPPED: say so, loudly.
      skipped=$(grep -c "^test .*SKIPPED" "$OUT/parity.log")
      [ "$skipped" = 0 ] || echo "WARNING: $skipped parity tests SKIPPED (no reference models in $BUNDLE/shared/models): they checked nothing" ;;
    ceiling)
      python3 - > "$OUT/ceiling.json" <<'EOF'
import json, torch, triton.testing as tt
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
ms = tt.do_bench(lambda: a @ b, warmup=200, rep=1000, return_mode="median")
print(json.dumps({"bf16_matmul_tflops": 2 * 8192**3 / ms / 1e9}))
EOF
      cat "$OUT/ceiling.json" ;;
    make:*)
      python3 scripts/make_random_checkpoints.py $CK --models "$name" --tokenizer-from "$BUNDLE/tokenizer" \
        > "$OUT/make_$name.log" 2>&1
      tail -1 "$OUT/make_$name.log" ;;
    grad:*)
      bins="after"; [ -x /tmp/statecut_before ] && [ "${BEFORE:-0}" = 1 ] && bins="after before"
      for bin in $bins; do
      exe=$SC; [ $bin = before ] && exe=/tmp/statecut_before
      for n in ${GRAD_SAMPLES:-128}; do
        tag=${name}_$n${GRAD_BATCH:+_b$GRAD_BATCH}; [ $bin = before ] && tag=${tag}_before
        rm -rf $CK/$name-grad
        peak "$OUT/grad_$tag.log" $exe prune -m $CK/$name --method grad --ratio 0.5 --calib "$DATA" \
          --nsamples $n --seqlen 2048 --device cuda --dtype bf16 ${GRAD_BATCH:+--batch-size $GRAD_BATCH} \
          -o $CK/$name-grad > "$OUT/grad_$tag.json"
        echo "grad $tag: $(cat "$OUT/grad_$tag.json")"; tail -2 "$OUT/grad_$tag.log"
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({'seconds': r['seconds'], 'memory': r.get('memory')}))" \
          $CK/$name-grad/statecut_report.json > "$OUT/grad_${tag}_stages.json" && cat "$OUT/grad_${tag}_stages.json"
        rm -rf $CK/$name-grad
      done; done ;;
    statecut:*)
      rm -rf $CK/$name-statecut
      peak "$OUT/statecut_$name.log" $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" \
        --nsamples 128 --seqlen 2048 --device cuda --dtype bf16 -o $CK/$name-statecut > "$OUT/statecut_$name.json"
      cat "$OUT/statecut_$name.json"; tail -2 "$OUT/statecut_$name.log"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps(r['seconds']))" \
        $CK/$name-statecut/statecut_report.json > "$OUT/statecut_${name}_stages.json" && cat "$OUT/statecut_${name}_stages.json" ;;
    reference:*)
      rm -rf $CK/$name-reference
      peak "$OUT/reference_$name.log" python3 scripts/reference_pipeline.py --model $CK/$name --data "$DATA" \
        --out $CK/$name-reference --json "$OUT/reference_${name}_stages.json" > "$OUT/reference_$name.json"
      cat "$OUT/reference_$name.json"; tail -2 "$OUT/reference_$name.log" ;;
    decode:*)
      python3 scripts/decode_bench.py --models $CK/$name $CK/$name-statecut --batch-sizes 1,16,64 \
        --json "$OUT/decode_$name.json" > "$OUT/decode_$name.log" 2>&1
      tail -6 "$OUT/decode_$name.log" ;;
    bench:*)
      $SC bench -m $CK/$name --compare $CK/$name-statecut --device cuda --dtype bf16 --prompt-len 512 \
        --batch-sizes 1,16,64 --json > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.log"
      echo "bench rc $?"; tail -3 "$OUT/bench_$name.log" ;;
    eager:*)
      model=$name; [ -d "$model" ] || model=$CK/$name
      tag=$(basename "$model")
      for r in $(seq 1 "${EAGER_ROUNDS:-3}"); do
        for bin in before after; do
          exe=$SC; [ $bin = before ] && exe=/tmp/statecut_before
          [ -x "$exe" ] || continue
          $exe bench -m "$model" --device cuda --dtype bf16 --eager --prompt-len ${PROMPT_LEN:-512} \
            --batch-sizes ${BATCHES:-1,16} --decode-steps 64 --iterations 5 --json \
            > "$OUT/eager_${bin}_${r}_$tag.json" 2> "$OUT/eager_${bin}_${r}_$tag.log"
          echo "eager $bin $r rc $?"
        done
      done
      python3 - "$OUT" "$tag" <<'EOF2'
import glob, json, statistics, sys
out, tag = sys.argv[1], sys.argv[2]
for bin in ("before", "after"):
    rows = {}
    for f in sorted(glob.glob(f"{out}/eager_{bin}_*_{tag}.json")):
        for m in json.load(open(f)):
            for r in m["rows"]:
                rows.setdefault(r["batch"], []).append(r)
    for b, rs in sorted(rows.items()):
        pf = statistics.median(r["prefill_tokens_per_s"] for r in rs)
        dec = statistics.median(r["decode_ms_per_token"] for r in rs if r["decode_ms_per_token"] is not None)
        print(f"{tag} {bin:6} batch {b:3}: prefill {pf:,.0f} tok/s, eager decode {dec:.3f} ms/token ({len(rs)} rounds)")
EOF2
      ;;
    speed:*)
      [ -d $CK/$name-statecut-0.75 ] || $SC prune -m $CK/$name --method drrqr --ratio 0.75 --calib "$DATA" \
        --nsamples ${PRUNE_SAMPLES:-128} --seqlen 2048 --device cuda --dtype bf16 -q -o $CK/$name-statecut-0.75 > /dev/null 2>&1
      for r in 0.5 0.75 ${EAGER:+0.5-eager}; do
        p=$CK/$name-statecut; [ $r = 0.75 ] && p=$CK/$name-statecut-0.75
        flags=""; [ $r = 0.5-eager ] && flags="--eager"
        $SC bench -m $CK/$name --compare $p --device cuda --dtype bf16 --prompt-len 512 --batch-sizes 1,16,64 \
          --decode-steps 100 $flags --json > "$OUT/speed_${name}_$r.json" 2> "$OUT/speed_${name}_$r.log"
        echo "bench $r rc $?"
        python3 -c "import json,sys; [print(m['model'], [(r['batch'], round(r['decode_ms_per_token'], 3), r.get('decode_graph')) for r in m['rows']]) for m in json.load(open(sys.argv[1]))]" "$OUT/speed_${name}_$r.json"
      done
      if [ "${GRAPHS:-1}" != 0 ]; then
        python3 scripts/decode_bench.py --graphs --steps 100 --warmup 10 --rounds 3 --batch-sizes 1,16,64 \
          --models $CK/$name $CK/$name-statecut $CK/$name-statecut-0.75 --json "$OUT/graphs_$name.json" \
          > "$OUT/graphs_$name.log" 2>&1
        echo "graphs rc $?"; grep "ms/step" "$OUT/graphs_$name.log"
      fi ;;
    state:*)
      python3 scripts/state_step_bench.py --models $CK/$name $CK/$name-statecut --batch-sizes 1,16,64 \
        --json "$OUT/state_$name.json" > "$OUT/state_$name.log" 2>&1
      tail -6 "$OUT/state_$name.log" ;;
    kernels:*)
      for k in ${KERNELS:-fused chunked}; do
        peak "$OUT/kernels_${name}_$k.log" env STATECUT_RECURRENCE=$k $SC eval -m $CK/$name --device cuda --dtype bf16 \
          --data "$DATA" --seqlen 2048 --windows 16 --batch-size 8 --json > "$OUT/kernels_${name}_$k.json"
        cat "$OUT/kernels_${name}_$k.json"; tail -1 "$OUT/kernels_${name}_$k.log"
      done ;;
    profile:*)
      rm -rf $CK/$name-profiled
      STATECUT_PROFILE=1 $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" --nsamples 32 \
        --seqlen 2048 --device cuda --dtype bf16 -q -o $CK/$name-profiled > "$OUT/profile_$name.log" 2>&1
      echo "profile rc $?"; tail -16 "$OUT/profile_$name.log"; rm -rf $CK/$name-profiled ;;
    calib:*)
      bins="after"; [ -x /tmp/statecut_before ] && bins="after before"
      # A fresh machine's first run pays one-off loading (10 s of it in the first MLP): warm up.
      $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" --nsamples 2 --seqlen 2048 --device cuda \
        --dtype bf16 -q -o $CK/$name-calib > /dev/null 2>&1; rm -rf $CK/$name-calib
      for kind in ${CALIB_KINDS:-profile full}; do
        runs=$bins; [ $kind = full ] && [ -n "${CALIB_BATCH:-}" ] && runs="$bins after_b$CALIB_BATCH"
        for which in $runs; do
          bin=$SC; [ $which = before ] && bin=/tmp/statecut_before
          batch=""; [ "$which" != "${which#after_b}" ] && batch="--batch-size ${which#after_b}"
          n=128; envs=""; [ $kind = profile ] && n=32 && envs=STATECUT_PROFILE=1
          log="$OUT/calib_${kind}_${which}_$name"
          rm -rf $CK/$name-calib
          env $envs $bin prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" --nsamples $n --seqlen 2048 \
            --device cuda --dtype bf16 $batch -q -o $CK/$name-calib > "$log.log" 2>&1
          echo "calib $kind $which rc $?"
          python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['seconds']))" \
            $CK/$name-calib/statecut_report.json > "$log.seconds.json" && cat "$log.seconds.json"
          [ $kind = profile ] && sed -n '/^stage /,/^total/p' "$log.log"
        done
      done
      rm -rf $CK/$name-calib ;;
    jit:*)
      echo "HOME=${HOME:-unset} CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-unset}; default cache: $(du -sh ${HOME:-/root}/.nv/ComputeCache 2>&1)"
      for run in ${JIT_RUNS:-off cold warm}; do
        envs="CUDA_CACHE_PATH=/tmp/jit_cache"; [ $run = off ] && envs="CUDA_CACHE_DISABLE=1"
        [ $run = default ] && envs=""  # the driver's own cache folder
        [ $run = cold ] && rm -rf /tmp/jit_cache
        log="$OUT/jit_${run}_$name"; rm -rf $CK/$name-jit
        t0=$(date +%s.%N)
        env $envs STATECUT_PROFILE=1 $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" --nsamples 8 \
          --seqlen 2048 --device cuda --dtype bf16 -q -o $CK/$name-jit > "$log.log" 2>&1
        echo "jit $run rc $? wall $(awk "BEGIN{print $(date +%s.%N) - $t0}") s, cache $(du -sh /tmp/jit_cache 2>/dev/null | cut -f1)"
        python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['seconds']))" \
          $CK/$name-jit/statecut_report.json
        sed -n '/^stage /,/^total/p' "$log.log" | head -12
      done
      rm -rf $CK/$name-jit ;;
    stream:*)
      for mode in resident streamed; do
        flags=""; [ $mode = streamed ] && flags="--max-device-memory ${BUDGET:-4GiB}"
        rm -rf $CK/$name-$mode
        peak "$OUT/stream_${name}_$mode.log" $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" \
          --nsamples ${NSAMPLES:-128} --seqlen 2048 --device cuda --dtype bf16 $flags -o $CK/$name-$mode \
          > "$OUT/stream_${name}_$mode.json"
        echo "$mode: $(cat "$OUT/stream_${name}_$mode.json")"; tail -2 "$OUT/stream_${name}_$mode.log"
        cp $CK/$name-$mode/statecut_report.json "$OUT/stream_${name}_${mode}_report.json" 2>/dev/null
        # the weights are not needed once the report is copied, and the disk holds one copy
        rm -f $CK/$name-$mode/*.safetensors
      done
      python3 - "$OUT/stream_${name}_resident_report.json" "$OUT/stream_${name}_streamed_report.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
kept = lambda r: [[h["kept"] for h in l["heads"]] for l in r["layers"]]
print(json.dumps({"same_kept_channels": kept(a) == kept(b), "memory": [a.get("memory"), b.get("memory")],
                  "seconds": [a["seconds"], b["seconds"]]}))
PY
      ;;
    streamonly:*)
      rm -rf $CK/$name-streamed
      peak "$OUT/streamonly_$name.log" $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" \
        --nsamples ${NSAMPLES:-128} --seqlen 2048 --device cuda --dtype bf16 --offload -o $CK/$name-streamed \
        > "$OUT/streamonly_$name.json"
      cat "$OUT/streamonly_$name.json"; tail -2 "$OUT/streamonly_$name.log"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({'seconds': r['seconds'], 'memory': r.get('memory'), 'layers': len(r['layers'])}))" \
        $CK/$name-streamed/statecut_report.json | tee "$OUT/streamonly_${name}_stages.json"
      rm -rf $CK/$name-streamed ;;
    passkey:*)
      for m in $name $name-statecut; do
        peak "$OUT/passkey_$m.log" $SC eval -m $CK/$m --task passkey --lengths 2048,4096 --samples ${SAMPLES:-8} \
          --filler "$DATA" --device cuda --dtype bf16 --json > "$OUT/passkey_$m.json"
        echo "$m: $(cat "$OUT/passkey_$m.json")"; tail -3 "$OUT/passkey_$m.log"
      done ;;
    recover:*)
      [ -d $CK/$name-rp50 ] || $SC prune -m $CK/$name --method drrqr --ratio 0.5 --calib "$DATA" --nsamples 8 \
        --seqlen 2048 --device cuda --dtype bf16 -q -o $CK/$name-rp50 > "$OUT/recover_prune_$name.log" 2>&1
      bins="after"; [ -x /tmp/statecut_before ] && [ "${BEFORE:-0}" = 1 ] && bins="after before"
      for bin in $bins; do
      exe=$SC; tag=$name; [ $bin = before ] && exe=/tmp/statecut_before && tag=${name}_before
      rm -rf $CK/$name-recovered
      peak "$OUT/recover_statecut_$tag.log" $exe recover -m $CK/$name-rp50 --teacher $CK/$name --data "$DATA" \
        --steps ${RECOVER_STEPS:-6} --batch-size ${RECOVER_BATCH:-16} --seqlen 2048 --warmup 0 --device cuda \
        --dtype bf16 ${RECOVER_ARGS:-} -o $CK/$name-recovered > "$OUT/recover_statecut_${tag}_peak.json"
      cp $CK/$name-recovered/statecut_recover.json "$OUT/recover_statecut_$tag.json" 2>/dev/null
      rm -rf $CK/$name-recovered
      echo "statecut $bin: $(cat "$OUT/recover_statecut_${tag}_peak.json")"
      python3 - "$OUT/recover_statecut_$tag.json" <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit("no statecut_recover.json: see recover_statecut_*.log")
r = json.load(open(sys.argv[1]))
mem = r.get("peak_memory_bytes")
print(json.dumps({"tokens_per_second": r["tokens_per_second"], "seconds": r["seconds"], "steps": r["steps"],
                  "trained_params": r["trained"]["params"], "peak_memory_gib": mem and mem / 2**30,
                  "loss": [round(h["loss"], 4) for h in r["history"]]}))
PY
      done
      [ "${RECOVER_REFERENCE:-1}" = 0 ] || for k in fla torch; do
        ref=$OUT/recover_reference_${name}_$k
        peak "$ref.log" python3 scripts/recover_reference.py --student $CK/$name-rp50 --teacher $CK/$name --kernel $k \
          --batch ${RECOVER_BATCH:-16} --steps ${RECOVER_STEPS:-6} --json "$ref.json" > "${ref}_peak.json"
        echo "reference $k: $(cat "${ref}_peak.json")"
        python3 - "$ref.json" <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit("no JSON: see the log")
r = json.load(open(sys.argv[1]))
keys = ["error"] if "error" in r else ["tokens_per_second", "tokens_per_second_all_steps", "seconds_per_step",
        "peak_memory_allocated_gib", "peak_memory_reserved_gib", "trainable_params", "checkpointing"]
out = {k: r.get(k) for k in keys}
if "history" in r:
    out["loss"] = [round(h["loss"], 4) for h in r["history"]]
print(json.dumps(out))
PY
        if [ $k = torch ]; then
          python3 scripts/recover_reference.py --self-test --device cuda --json "$OUT/recover_reference_selftest.json" \
            > "$OUT/recover_reference_selftest.log" 2>&1
          echo "self-test rc $?: $(tail -1 "$OUT/recover_reference_selftest.log")"
        fi
        # fla's kernels ran the whole fine-tune: the plain-PyTorch rule is not needed
        python3 -c 'import json, sys; sys.exit("error" in json.load(open(sys.argv[1])))' "$ref.json" 2>/dev/null && break
      done ;;
    mixer:*)
      # name = SHAPE/DECAY, e.g. mixer:16,2048,16,128,128/head: the recurrence alone, statecut's
      # forms (benches/recurrence.rs) then fla's chunk kernels, in one process each.
      shape=${name%/*}; decay=${name#*/}; tag=$(echo "${shape}_$decay" | tr , x)
      /tmp/recurrence --shape "$shape" --decay "$decay" --iterations ${ITERATIONS:-5} ${FORMS:+--forms $FORMS} \
        > "$OUT/mixer_$tag.jsonl" 2> "$OUT/mixer_$tag.log"
      [ "${FLA:-1}" = 0 ] || python3 scripts/recurrence_reference.py --shape "$shape" --decay "$decay" --iterations ${ITERATIONS:-5} \
        >> "$OUT/mixer_$tag.jsonl" 2>> "$OUT/mixer_$tag.log"
      python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); print("%32s %17s %s" % (r["form"], r["pass"], r.get("ms", r.get("error"))))' "$OUT/mixer_$tag.jsonl"
      tail -2 "$OUT/mixer_$tag.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
  tar -czf "$DEST/results.tgz" -C "$OUT" .
done
echo "=== done ($(date +%T))"
