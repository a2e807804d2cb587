#!/bin/bash
# One call: stages in $STAGES, each skipped when fewer than its estimate of LIMIT seconds are left;
# results packed into $OUT/<stage>.tgz.
#   parity   gpu_parity of the new build
#   mixer    the recurrence alone (--forms chunked-kernels --grad seed), main and new taking turns, two rounds
#   ncu      per-kernel detail (occupancy, warp stalls, instruction mix) of the new build's chunk kernels
#   rec      recovery 16 x 2048 x 6 steps, DeltaNet and Gated DeltaNet 1.3B: new, main as before
#   budget   DeltaNet within --train-memory 45GiB: new, main as before
set -u
source .dev/calls/setup.sh
R=$O; W=/tmp/res; mkdir -p $W
LIMIT=${LIMIT:-575}
NEW=${NEW:-ob5}; OLD=${OLD:-obg}
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
pack() { tar -czf $R/$1.tgz -C $W/$1 . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
st_parity() {
  /tmp/bins/$NEW/gpu_parity --test-threads 1 > $1/parity.log 2>&1; rc=$?
  echo "parity $NEW rc $rc"; grep -E "test result" $1/parity.log; grep -E "FAILED|panicked" $1/parity.log | head -5
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
st_mixer() { builds="$OLD $NEW"; mixer; builds="$NEW $OLD"; mixer; cp $W/mixer.* $1/; }
st_ncu() {
  local NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for spec in "chunk_out_bwd_tc:1:bwd"; do
    IFS=: read rx cnt nm <<< "$spec"
    timeout 100 $NCU --clock-control none -k regex:"$rx" --launch-count $cnt \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      /tmp/bins/$NEW/recurrence --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels --grad seed > $1/ncu_$nm.txt 2>$1/ncu_$nm.log
    grep -E "chunk_.*_tc|Duration|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy" $1/ncu_$nm.txt | head -20
  done
  for b in $OLD $NEW; do
    timeout 90 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      /tmp/bins/$b/recurrence --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels --grad seed > $1/times_$b.csv 2>$1/times_$b.log
    python3 scripts/kernel_times.py $1/times_$b.csv --top 30 > $1/times_$b.txt 2>&1; echo "== ncu $b"; head -40 $1/times_$b.txt
  done
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
st_rec() { mk $NEW $OLD; BEFORE=1 bench $1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh /tmp/bund_$NEW $1 recover:delta_net_1p3b recover:gdn_1p3b; }
st_budget() { mk $NEW $OLD; BEFORE=1 bench $1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="--train-memory 45GiB" bash scripts/gpu_bench.sh /tmp/bund_$NEW $1 recover:delta_net_1p3b; }
declare -A est=([parity]=90 [mixer]=110 [ncu]=150 [rec]=200 [budget]=60)
for s in ${STAGES:-parity mixer ncu rec budget}; do
  if [ $(left) -lt ${est[$s]} ]; then echo "=== skip $s ($(left)s left)"; continue; fi
  mkdir -p $W/$s; echo "=== $s at $(( $(date +%s) - t0 ))s"
  st_$s $W/$s 2>&1 | tee $W/$s/out.txt
  pack $s
done
echo "=== end at $(( $(date +%s) - t0 ))s"
