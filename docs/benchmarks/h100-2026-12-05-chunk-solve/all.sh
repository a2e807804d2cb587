#!/bin/bash
# One call: the stages named in $STAGES (default: all, in order), each skipped when the time left
# (LIMIT seconds from the start) is less than its estimate; results packed into $OUT/<stage>.tgz.
#   parity   gpu_parity of gpu/both (and main's when it fails)
#   mixer1/2 the recurrence alone (benches/recurrence.rs --forms chunked-kernels --grad seed), builds
#            main, interleaved, solve-bwd, both taking turns, three shapes (round 1, round 2 reversed)
#   rec      recovery 16 x 2048 x 6 steps, DeltaNet and Gated DeltaNet 1.3B: both and 8b0b552 (before)
#   budget   DeltaNet within --train-memory 45GiB: both and before
#   recmain  main's build: both models, then within the budget
#   fla      fla 0.6.0's chunk kernels at the mixer's shapes
#   ncu      per-kernel GPU time, main and both, at the pruned DeltaNet shape
set -u
source .dev/calls/setup.sh
R=$O; W=/tmp/res; mkdir -p $W
LIMIT=${LIMIT:-575}
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
pack() { tar -czf $R/$1.tgz -C $W/$1 . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
st_parity() {
  /tmp/bins/both/gpu_parity --test-threads 1 > $1/parity_both.log 2>&1; rc=$?
  echo "parity both rc $rc"; grep -E "test result" $1/parity_both.log; grep -E "FAILED|panicked" $1/parity_both.log | head -5
  if [ $rc != 0 ]; then /tmp/bins/main/gpu_parity --test-threads 1 > $1/parity_main.log 2>&1; echo "parity main rc $?"; fi
}
mixer() {
  for s in "16,2048,16,64,128 none" "16,2048,8,128,256 head" "16,2048,16,128,128 none"; do
    set -- $s
    for b in $builds; do
      /tmp/bins/$b/recurrence --shape $1 --decay $2 --iterations 5 --forms chunked-kernels --grad seed 2>>$W/mixer.log \
        | sed "s/^{/{\"build\":\"$b\",/" | tee -a $W/mixer.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r["build"], r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3), r.get("graph_mib"))'
    done
  done
}
st_mixer1() { builds="main inter solve both"; mixer; cp $W/mixer.* $1/; }
st_mixer2() { builds="both solve inter main"; mixer; cp $W/mixer.* $1/; }
st_fla() {
  local d=$1
  for s in "16,2048,16,64,128 none" "16,2048,16,128,128 none" "16,2048,8,128,256 head"; do
    set -- $s
    timeout 100 python3 scripts/recurrence_reference.py --shape $1 --decay $2 --iterations 5 --grad seed >> $d/fla.jsonl 2>>$d/fla.log
  done 2>/dev/null
  true
}
mk() {
  d=/tmp/bund_$1; [ -d $d ] && return; mkdir -p $d/shared/data; cp -r .dev/common/whl .dev/common/tokenizer $d/; cp -r .dev/common/shared/data/calib $d/shared/data/
  xz -0 -T0 -c /tmp/bins/$1/statecut > $d/statecut.xz
  [ -n "${2:-}" ] && xz -0 -T0 -c /tmp/bins/$2/statecut > $d/statecut_before.xz; true
}
bench() { d=$1; shift; rm -rf /tmp/gpu_bench_results; env "$@" > $d/stdout.txt 2>&1; grep -E "statecut (after|before)" $d/stdout.txt
  mkdir -p $d/x; tar xzf $d/results.tgz -C $d/x 2>/dev/null; python3 -c 'import json,sys,glob
for f in sorted(glob.glob(sys.argv[1] + "/x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(f.split("/")[-1], [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2), round(r["tokens_per_second"]))' $d
  for f in $d/x/recover_statecut_*.log; do echo "$(basename $f): $(tr '\r' '\n' < $f | grep -E "blocks keep|kept" | head -1)"; done; rm -rf $d/x; }
st_rec() { mk both before; BEFORE=1 bench $1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh /tmp/bund_both $1 recover:delta_net_1p3b recover:gdn_1p3b; }
st_budget() { mk both before; BEFORE=1 bench $1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="--train-memory 45GiB" bash scripts/gpu_bench.sh /tmp/bund_both $1 recover:delta_net_1p3b; }
st_recmain() { mk main; mkdir -p $1/a $1/b; bench $1/a RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh /tmp/bund_main $1/a recover:delta_net_1p3b recover:gdn_1p3b
  bench $1/b RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="--train-memory 45GiB" bash scripts/gpu_bench.sh /tmp/bund_main $1/b recover:delta_net_1p3b; }
st_ncu() {
  for b in main both; do
    timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      /tmp/bins/$b/recurrence --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels --grad seed > $1/ncu_$b.csv 2>$1/ncu_$b.log
    python3 scripts/kernel_times.py $1/ncu_$b.csv --top 25 > $1/ncu_$b.txt 2>&1; echo "== ncu $b"; head -30 $1/ncu_$b.txt
  done
}
declare -A est=([parity]=150 [mixer1]=100 [mixer2]=100 [rec]=200 [budget]=60 [recmain]=120 [fla]=120 [ncu]=150)
for s in ${STAGES:-parity mixer1 rec budget mixer2 fla recmain ncu}; do
  if [ $(left) -lt ${est[$s]} ]; then echo "=== skip $s ($(left)s left)"; continue; fi
  mkdir -p $W/$s; echo "=== $s at $(( $(date +%s) - t0 ))s"
  st_$s $W/$s 2>&1 | tee $W/$s/out.txt
  pack $s
done
echo "=== end at $(( $(date +%s) - t0 ))s"
