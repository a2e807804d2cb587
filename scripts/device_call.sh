#!/usr/bin/env bash
# One GPU call comparing two builds of statecut, NEW and OLD, stage by stage, within LIMIT
# seconds; each stage's logs are packed into $OUT/<stage>.tgz as it ends, so a call cut short
# returns what it finished. Run on the GPU machine from the repository root:
#
#   NEW=a OLD=b STAGES="parity budget" LIMIT=560 ROUNDS=2 bash scripts/device_call.sh
#
# BUNDLES (default .dev/bundles) holds <build>/bins.tar.xz, a tar of <build>/ (and of other
# builds' folders, which then need no bundle of their own) with the stripped release binaries
# statecut, gpu_parity and recurrence (benches/recurrence.rs), each built with --features cuda;
# a stage skips a binary the tar lacks. COMMON (default .dev/common) holds whl/ (fla),
# tokenizer/ (tokenizer files for the random checkpoints) and shared/data/calib/ (calibration
# text). Stages, NEW and OLD taking turns where both run:
#   parity   the CUDA parity tests of NEW
#   mixer    the recurrence alone (chunk kernels, forward and forward + backward, bf16) at the
#            pruned DeltaNet's, the pruned Gated DeltaNet's and dk 128 shapes, ROUNDS rounds;
#            builds named in EXTRA (their recurrence binaries in NEW's or OLD's bundle) are
#            timed in the same rounds
#   ncu      per-kernel GPU time of the chunk kernels, OLD and NEW, from ncu
#   ncuall   per-kernel GPU time of every kernel of NEW's recurrence bench
#   rec      recovery of the 1.3B DeltaNet and Gated DeltaNet (scripts/gpu_bench.sh recover:NAME,
#            16 x 2048 tokens, 6 steps, --recompute auto), ROUNDS rounds, the first build of a
#            round alternating
#   budget   the same within --train-memory 45GiB (REC_MODELS, as gpu_bench.sh stages, narrows both)
#   fla      fla's chunk_delta_rule beside NEW's recurrence at dk 64 and 128
#   stepncu  per-kernel GPU time (ncu) of one DeltaNet 1.3B recovery step of NEW within
#            --train-memory 45GiB, 16 x 2048 tokens
#   calib    calibration of the 1.3B DeltaNet and Gated DeltaNet, profiled (STATECUT_PROFILE=1,
#            32 x 2048 tokens) and timed (128 x 2048), NEW then OLD (scripts/gpu_bench.sh calib:NAME)
#   ceiling  the bf16 matmul ceiling of this GPU (scripts/gpu_bench.sh ceiling: torch, 8192^3),
#            from which calibration's floors follow on the same machine
#   nsys     the GPU timeline of one unprofiled calibration of the DeltaNet 1.3B (128 x 2048, NEW,
#            after stage calib made the checkpoint) under Nsight Systems, where the machine has it:
#            driver calls by total time, and the GPU's busy share in each 100 ms of the run
#   jit      the JIT experiment of scripts/gpu_bench.sh jit:NAME on the DeltaNet 1.3B, for each build
#            of JIT_BUILDS in turn (default NEW)
#   grad     the Grad selector on the Gated DeltaNet 1.3B (scripts/gpu_bench.sh grad:gdn_1p3b,
#            128 x 2048 tokens), NEW then OLD: time and peak memory
#   nograd   the recurrence's forward without gradients, the fused kernel against the chunk
#            kernels, at the unpruned teachers' shapes (B = 16, T = 2048)
#   blocks   the fused recurrence's forward in each block shape of the launcher (warps a block,
#            state columns a thread; r16: 16 key rows a thread) at the teachers' and calibration's
#            shapes
#   fchunks  the fused op's forward, sequential (fused) against its chunked form (fused-chunks), at
#            calibration's, the teachers' and the pruned students' shapes and at short lengths;
#            the chunked form of the builds in EXTRA too
#   fdetail  ncu's full section set for one launch of the fused op's chunked form at calibration's
#            DeltaNet (dk 128) and Gated DeltaNet (dk 256) shapes, as detail's pages
#   detail   ncu's full section set for one launch of each tensor-core chunk kernel of NEW at
#            the pruned DeltaNet's shape: the details page as text, the per-instruction source
#            page (SASS, stall samples) as xz'd CSV
set -u
NEW=${NEW:?NEW names the build under test}
OLD=${OLD:-}
BUNDLES=${BUNDLES:-.dev/bundles}
COMMON=${COMMON:-.dev/common}
LIMIT=${LIMIT:-560}
ROUNDS=${ROUNDS:-2}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
R=${OUT:-/tmp/out}; W=/tmp/device_call; mkdir -p "$R"; rm -rf $W /tmp/bins /tmp/bund_*; mkdir -p $W /tmp/bins
# A bundle may hold several builds (one xz archive dedupes their shared kernels): a build that
# an earlier bundle brought needs no bundle of its own.
for b in $NEW $OLD; do
  [ -d /tmp/bins/$b ] && continue
  if [ -f "$BUNDLES/$b/bins.tar.xz" ]; then xz -dc "$BUNDLES/$b/bins.tar.xz" | tar -x -C /tmp/bins || exit 1
  else for f in "$BUNDLES"/*/bins.tar.xz; do [ -d /tmp/bins/$b ] || xz -dc "$f" | tar -x -C /tmp/bins; done; fi
  [ -d /tmp/bins/$b ] || { echo "no bundle holds the build $b"; exit 1; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$COMMON"/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$LIBS:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
left() { echo $((LIMIT - ($(date +%s) - t0))); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1

st_parity() {
  timeout 150 /tmp/bins/$NEW/gpu_parity --test-threads 1 > $1/parity_$NEW.log 2>&1
  echo "parity $NEW rc $?"; grep -E "test result" $1/parity_$NEW.log; grep -E "FAILED|panicked" $1/parity_$NEW.log | head -5
}

# The recurrence alone for the builds in $1, in that order, at the three shapes.
mixer_round() {
  for s in "16,2048,16,64,128 none" "16,2048,8,128,256 head" "16,2048,16,128,128 none"; do
    set -- $s
    for b in $order; do
      /tmp/bins/$b/recurrence --shape $1 --decay $2 --iterations 5 --forms chunked-kernels --grad seed 2>>$W/mixer/mixer.log |
        sed "s/^{/{\"build\":\"$b\",/" | tee -a $W/mixer/mixer.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r["build"], r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))'
    done
  done
}
st_mixer() {
  for r in $(seq $ROUNDS); do
    if ((r % 2)); then order="${EXTRA:-} $OLD $NEW"; else order="$NEW $OLD ${EXTRA:-}"; fi
    mixer_round
  done
}

ncu_times() { # build shape decay name filter
  timeout 90 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base $5 \
    /tmp/bins/$1/recurrence --shape $2 --decay $3 --iterations 1 --forms chunked-kernels --grad seed > $W/ncu_$1_$4.csv 2> $W/ncu_$1_$4.log
  python3 scripts/kernel_times.py $W/ncu_$1_$4.csv --top 40 > $6/t_$1_$4.txt 2>&1
  echo "== ncu $1 $4"; sed -n '/top/,$p' $6/t_$1_$4.txt
}
st_ncu() {
  for b in $OLD $NEW; do
    ncu_times $b 16,2048,16,64,128 none dn "-k regex:chunk_|_chunks" $1
    ncu_times $b 16,2048,8,128,256 head gdn "-k regex:chunk_|_chunks" $1
  done
}
st_ncuall() {
  ncu_times $NEW 16,2048,16,64,128 none dn "" $1
  ncu_times $NEW 16,2048,8,128,256 head gdn "" $1
}

# A gpu_bench.sh bundle with build $1 as statecut and $2 (if given) as statecut_before.
bundle() {
  local d=/tmp/bund_$1_${2:-none}
  if [ ! -d $d ]; then
    mkdir -p $d/shared/data; cp -r "$COMMON"/whl "$COMMON"/tokenizer $d/; cp -r "$COMMON"/shared/data/calib $d/shared/data/
    xz -0 -T0 -c /tmp/bins/$1/statecut > $d/statecut.xz
    # A build whose bundle brought no statecut (a recurrence-only build) has no "before" run.
    [ -n "$2" ] && [ -f /tmp/bins/$2/statecut ] && xz -0 -T0 -c /tmp/bins/$2/statecut > $d/statecut_before.xz
  fi
  echo $d
}
# Recovery of both 1.3B checkpoints, each build in turn; $2: extra recover flags.
recover_round() {
  local d=$1/round$3; mkdir -p $d; rm -rf /tmp/gpu_bench_results
  BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="$2" \
    bash scripts/gpu_bench.sh "$(bundle $4 $5)" $d ${REC_MODELS:-recover:delta_net_1p3b recover:gdn_1p3b} > $d/stdout.txt 2>&1
  mkdir -p $d/x; tar xzf $d/results.tgz -C $d/x 2>/dev/null
  python3 - $d $4 $5 <<'PY'
import glob, json, sys
d, first, second = sys.argv[1:]
for f in sorted(glob.glob(d + "/x/recover_statecut_*.json")):
    if f.endswith("_peak.json"):
        continue
    r = json.load(open(f)); h = r["history"]
    name = f.split("/")[-1][len("recover_statecut_"):-len(".json")]
    name = name[:-len("_before")] + " " + second if name.endswith("_before") else name + " " + first
    print(name, [round(s["seconds"], 3) for s in h], [round(s["loss"], 4) for s in h],
          round(r.get("peak_memory_bytes", 0) / 2**30, 2), round(r["tokens_per_second"]))
PY
  rm -rf $d/x
}
recover_rounds() {
  for r in $(seq $ROUNDS); do
    if ((r % 2)); then recover_round $1 "$2" $r $NEW $OLD; else recover_round $1 "$2" $r $OLD $NEW; fi
  done
}
st_rec() { recover_rounds $1 ""; }
st_budget() { recover_rounds $1 "--train-memory 45GiB"; }

st_fla() {
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  for s in 16,2048,16,64,128 16,2048,16,128,128; do
    # fla's first launches compile its Triton kernels (a minute or more on a fresh machine): within LIMIT.
    local t=$(( $(left) - 15 )); [ $t -gt 120 ] && t=120; [ $t -lt 10 ] && break
    timeout $t python3 scripts/recurrence_reference.py --shape $s --decay none --iterations 5 --grad seed >> $1/fla.jsonl 2>> $1/fla.log
    /tmp/bins/$NEW/recurrence --shape $s --decay none --iterations 5 --forms chunked-kernels --grad seed >> $1/statecut.jsonl 2>> $1/statecut.log
  done
  python3 - $1 <<'PY'
import json, sys
for f in ("fla", "statecut"):
    for l in open(sys.argv[1] + "/" + f + ".jsonl"):
        try:
            r = json.loads(l)
        except ValueError:
            continue
        print(f, r.get("form"), r.get("dk"), r.get("pass"), round(r["ms"], 3))
PY
}

st_stepncu() {
  local d=$(bundle $NEW "") M=delta_net_1p3b CK=/tmp/ck
  rm -rf /tmp/gpu_bench_results
  RECOVER_REFERENCE=0 RECOVER_STEPS=2 RECOVER_ARGS="--train-memory 45GiB" \
    bash scripts/gpu_bench.sh $d $1/warm recover:$M > $1/warm.txt 2>&1
  grep -E "statecut after" $1/warm.txt
  timeout $(( $(left) - 30 )) $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    /tmp/bins/$NEW/statecut recover -m $CK/$M-rp50 --teacher $CK/$M --data $d/shared/data/calib/wiki.jsonl --steps 1 \
    --batch-size 16 --seqlen 2048 --warmup 0 --device cuda --dtype bf16 --train-memory 45GiB -q -o $CK/ncu-rec \
    > $W/step.csv 2> $1/ncu.err
  echo "ncu rc $?"; tail -2 $1/ncu.err
  python3 scripts/kernel_times.py $W/step.csv --top 80 --json $1/step_summary.json > $1/step.txt 2>&1; head -100 $1/step.txt
  xz -6 -c $W/step.csv > $1/step.csv.xz; rm -rf $CK/ncu-rec
}

st_grad() {
  local d=$(bundle $NEW "$OLD")
  BEFORE=1 GRAD_SAMPLES=128 bash scripts/gpu_bench.sh $d $1/x grad:gdn_1p3b > $1/stdout.txt 2>&1
  grep -E "^grad|seconds|peak" $1/stdout.txt
  mkdir -p $1/r; tar xzf $1/x/results.tgz -C $1/r 2>/dev/null; rm -rf $1/x
}

st_calib() {
  local d=$(bundle $NEW "$OLD")
  bash scripts/gpu_bench.sh $d $1/x calib:delta_net_1p3b calib:gdn_1p3b > $1/stdout.txt 2>&1
  grep -vE "^===" $1/stdout.txt
  mkdir -p $1/r; tar xzf $1/x/results.tgz -C $1/r 2>/dev/null; rm -rf $1/x
}

st_ceiling() {
  bash scripts/gpu_bench.sh $(bundle $NEW "") $1/x ceiling > $1/stdout.txt 2>&1
  grep -vE "^===" $1/stdout.txt
}

st_nsys() {
  local nsys; nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
    /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  [ -n "$nsys" ] || { echo "no nsys on this machine: $(ls /usr/local/cuda/bin 2>&1 | tr '\n' ' ')"; return; }
  local M=/tmp/ck/delta_net_1p3b
  [ -d $M ] || { echo "no $M (run stage calib first)"; return; }
  rm -rf /tmp/ck/nsys-calib
  timeout $(( $(left) - 20 )) $nsys profile --trace=cuda --sample=none --cpuctxsw=none -o $W/calib \
    /tmp/bins/$NEW/statecut prune -m $M --method drrqr --ratio 0.5 --calib $COMMON/shared/data/calib/wiki.jsonl \
    --nsamples 128 --seqlen 2048 --device cuda --dtype bf16 -q -o /tmp/ck/nsys-calib > $1/run.txt 2>&1
  echo "nsys rc $?"; tail -3 $1/run.txt
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['seconds']))" /tmp/ck/nsys-calib/statecut_report.json
  $nsys stats --report cuda_api_sum --format csv -o $1/api $W/calib.nsys-rep > /dev/null 2>&1
  $nsys stats --report cuda_gpu_trace --format csv -o $W/trace $W/calib.nsys-rep > /dev/null 2>&1
  head -25 $1/api*.csv | cut -c1-160
  python3 - $W/trace*.csv <<'PY' | tee $1/busy.txt
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
iv = sorted((int(r["Start (ns)"]), int(r["Start (ns)"]) + int(r["Duration (ns)"]), r["Name"]) for r in rows)
t0, t1 = iv[0][0], max(e for _, e, _ in iv)
print(f"{len(iv)} GPU operations over {(t1 - t0) / 1e9:.3f} s")
# Busy time (union of intervals) in each 100 ms window, and the gaps over 2 ms.
win = 100_000_000; n = (t1 - t0) // win + 1; busy = [0] * n; cur_s = cur_e = None; gaps = []
def add(a, b):
    while a < b:
        w = (a - t0) // win; e = min(b, t0 + (w + 1) * win); busy[w] += e - a; a = e
for s, e, name in iv:
    if cur_e is None or s > cur_e:
        if cur_e is not None:
            add(cur_s, cur_e)
            if s - cur_e > 2_000_000: gaps.append(((cur_e - t0) / 1e6, (s - cur_e) / 1e6, name[:60]))
        cur_s, cur_e = s, e
    else:
        cur_e = max(cur_e, e)
add(cur_s, cur_e)
print("busy share per 100 ms:", " ".join(f"{b / win:.2f}" for b in busy))
print("gaps over 2 ms (at ms, length ms, next op):")
for g in gaps[:60]: print(f"  {g[0]:10.1f} {g[1]:8.1f}  {g[2]}")
PY
  rm -rf /tmp/ck/nsys-calib
}

st_jit() {
  local i=0
  for b in ${JIT_BUILDS:-$NEW}; do
    i=$((i + 1)); echo "== $b"
    bash scripts/gpu_bench.sh $(bundle $b "") $1/x$i jit:delta_net_1p3b > $1/stdout$i.txt 2>&1
    grep -vE "^===" $1/stdout$i.txt
    mkdir -p $1/r$i; tar xzf $1/x$i/results.tgz -C $1/r$i 2>/dev/null; rm -rf $1/x$i
  done
}

st_nograd() {
  for s in "16,2048,16,128,128 none" "16,2048,8,256,256 head"; do
    set -- $s
    /tmp/bins/$NEW/recurrence --shape $1 --decay $2 --iterations 5 --forms fused,chunked-kernels 2>>$W/nograd.log |
      tee -a $W/nograd.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r.get("form"), r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))'
  done
}

# The fused recurrence's forward in each block shape (STATECUT_RECURRENCE_BLOCK; "auto" is the
# launcher's pick) at the teachers' and calibration's shapes, NEW then OLD ("auto" only), ROUNDS
# rounds.
st_blocks() {
  local d=$1
  for r in $(seq $ROUNDS); do
    for s in "16,2048,16,128,128 none" "8,2048,16,128,128 none" "16,2048,16,64,128 none" \
             "16,2048,8,256,256 head" "8,2048,8,256,256 head"; do
      set -- $s
      for blk in auto 8,1 8,2 4,1 4,2 r16:8,1 r16:8,2 old; do
        b=$NEW; envs=""
        [ $blk = old ] && { [ -n "$OLD" ] && [ -x /tmp/bins/$OLD/recurrence ] || continue; b=$OLD; }
        case $blk in auto|old) ;; r16:*) envs="STATECUT_RECURRENCE_ROWS=16 STATECUT_RECURRENCE_BLOCK=${blk#r16:}" ;;
          *) envs="STATECUT_RECURRENCE_BLOCK=$blk" ;; esac
        env $envs /tmp/bins/$b/recurrence --shape $1 --decay $2 --iterations 7 --forms fused 2>>$d/blocks.log |
          sed "s/^{/{\"block\":\"$blk\",/" | tee -a $d/blocks.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r["block"], r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))'
      done
    done
  done
}

st_fchunks() {
  local d=$1
  for r in $(seq $ROUNDS); do
    for s in "8,2048,16,128,128 none" "8,2048,8,256,256 head" "16,2048,16,128,128 none" \
             "16,2048,8,256,256 head" "16,2048,16,64,128 none" "16,2048,8,128,256 head" "1,2048,16,128,128 none" \
             "1,64,16,128,128 none" "1,256,16,128,128 none" "8,256,16,128,128 none" "64,128,16,128,128 none"; do
      set -- $s
      for b in $NEW ${EXTRA:-}; do
        forms=fused-chunks; [ $b = $NEW ] && forms=fused,fused-chunks
        /tmp/bins/$b/recurrence --shape $1 --decay $2 --iterations 7 --forms $forms 2>>$d/fchunks.log |
          sed "s/^{/{\"build\":\"$b\",/" | tee -a $d/fchunks.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r["build"], r["form"], r["b"], r["t"], r["h"], r["dk"], r["dv"], r["decay"], round(r["ms"],3))'
      done
    done
  done
}

st_detail() {
  for k in chunk_walk_fwd_tc_k64 chunk_intra_fwd_tc chunk_out_fwd_tc chunk_walk_bwd_tc_k64 chunk_intra_bwd_tc chunk_out_bwd_tc; do
    timeout 120 $NCU --clock-control none --set full --import-source yes -k $k --launch-count 1 -f -o $W/$k \
      /tmp/bins/$NEW/recurrence --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels \
      --grad seed > $1/$k.log 2>&1
    echo "== $k rc $?"
    $NCU -i $W/$k.ncu-rep --page details > $1/$k.details.txt 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Block Limit" $1/$k.details.txt | head -12
    # SASS with its samples; a build with line tables (STATECUT_CUDA_LINEINFO=1, build.rs) also
    # lets the report, whose source is imported, name each instruction's .cu line
    $NCU -i $W/$k.ncu-rep --page source --csv --print-source sass > $W/$k.source.csv 2> $1/$k.source.err
    xz -6 -c $W/$k.source.csv > $1/$k.source.csv.xz
  done
}

st_fdetail() {
  local D=$1
  for s in "chunk_fused_fwd_128 8,2048,16,128,128 none" "chunk_fused_fwd_256 8,2048,8,256,256 head"; do
    set -- $s
    timeout 120 $NCU --clock-control none --set full --import-source yes -k $1 --launch-count 1 -f -o $W/$1 \
      /tmp/bins/$NEW/recurrence --shape $2 --decay $3 --iterations 1 --forms fused-chunks > $D/$1.log 2>&1
    echo "== $1 rc $?"
    $NCU -i $W/$1.ncu-rep --page details > $D/$1.details.txt 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput" $D/$1.details.txt | head -8
    $NCU -i $W/$1.ncu-rep --page source --csv --print-source sass > $W/$1.source.csv 2> $D/$1.source.err
    xz -6 -c $W/$1.source.csv > $D/$1.source.csv.xz
  done
}

# Seconds each stage needs to be worth starting (a recovery round of both models ~ 110 s).
declare -A need=([parity]=40 [mixer]=$((15 * ROUNDS)) [ncu]=20 [ncuall]=25 [rec]=$((130 * ROUNDS)) [budget]=$((110 * ROUNDS)) [fla]=60 [stepncu]=200 [calib]=120 [jit]=60 [ceiling]=20 [nsys]=60 [nograd]=20 [detail]=90 [blocks]=60 [fchunks]=40 [fdetail]=60)
for s in ${STAGES:-parity budget}; do
  if [ $(left) -lt ${need[$s]:-0} ]; then echo "=== skip $s ($(left) s left)"; continue; fi
  mkdir -p $W/$s; echo "=== $s at $(($(date +%s) - t0)) s"
  st_$s $W/$s 2>&1 | tee $W/$s/out.txt
  tar -czf $R/$s.tgz -C $W/$s . 2>/dev/null
done
echo "=== end at $(($(date +%s) - t0)) s"
