#!/bin/bash
# One call: parity of ad (26d15f1: the recurrence's inputs linked, ops::link); the
# recurrence alone, h0 (7a804e0) and ad taking turns over two rounds; recovery of the 1.3B DeltaNet
# and Gated DeltaNet, ad then h0; both within --train-memory 45GiB, ad then h0; per-kernel times
# of one DeltaNet step if time is left. Results in $OUT/*.tgz.
set -u
source .dev/calls/setup13.sh
R=$O; W=/tmp/res; mkdir -p $W
LIMIT=${LIMIT:-570}
NEW=ad; OLD=h0; BASE=h0
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
pack() { tar -czf $R/$1.tgz -C $W/$1 . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
st_parity() {
  for b in $NEW; do
  timeout 150 /tmp/bins/$b/gpu_parity --test-threads 1 > $1/parity_$b.log 2>&1; rc=$?
  echo "parity $b rc $rc"; grep -E "test result" $1/parity_$b.log; grep -E "FAILED|panicked" $1/parity_$b.log | head -5
  done
}
mixer() {
  for s in "16,2048,16,64,128 none" "16,2048,8,128,256 head" "16,2048,16,128,128 none"; do
    set -- $s
    for b in $builds; do
      /tmp/bins/$b/recurrence --shape $1 --decay $2 --iterations 5 --forms chunked-kernels --grad seed 2>>$W/mixer/mixer.log \
        | sed "s/^{/{\"build\":\"$b\",/" | tee -a $W/mixer/mixer.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r["build"], r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))'
    done
  done
}
st_mixer() { builds="$OLD $NEW"; mixer; builds="$NEW $OLD"; mixer; }
st_ncu() {
  local NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for b in $OLD $NEW; do
    for sh in "16,2048,16,64,128:none:dn" "16,2048,8,128,256:head:gdn"; do
      IFS=: read shape dec nm <<< "$sh"
      timeout 60 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base -k regex:'chunk_|_chunks' \
        /tmp/bins/$b/recurrence --shape $shape --decay $dec --iterations 1 --forms chunked-kernels --grad seed > $1/t_${b}_$nm.csv 2>$1/t_${b}_$nm.log
      python3 scripts/kernel_times.py $1/t_${b}_$nm.csv --top 14 > $1/t_${b}_$nm.txt 2>&1; echo "== ncu $b $nm"; sed -n '/top/,$p' $1/t_${b}_$nm.txt
    done
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
st_rec() { mk $NEW $OLD
  BEFORE=1 bench $1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh /tmp/bund_$NEW $1 recover:delta_net_1p3b recover:gdn_1p3b; }
st_budget() { mk $NEW $OLD; d=/tmp/bund_$NEW
  BEFORE=1 bench $1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="--train-memory 45GiB" bash scripts/gpu_bench.sh $d $1 recover:delta_net_1p3b recover:gdn_1p3b; }
st_fla() {
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  for s in "16,2048,16,64,128" "16,2048,16,128,128"; do
    timeout 120 python3 scripts/recurrence_reference.py --shape $s --decay none --iterations 5 --grad seed >> $1/fla.jsonl 2>>$1/fla.log
    echo "fla $s rc $?"
    /tmp/bins/$NEW/recurrence --shape $s --decay none --iterations 5 --forms chunked-kernels --grad seed >> $1/statecut.jsonl 2>>$1/statecut.log
  done
  python3 - $1 <<'PY'
import json,sys
for f in ("fla","statecut"):
    for l in open(sys.argv[1]+"/"+f+".jsonl"):
        try: r=json.loads(l)
        except Exception: continue
        print(f, r.get("form"), r.get("dk"), r.get("pass"), round(r["ms"],3))
PY
  tail -2 $1/fla.log
}
st_ncuall() {
  local NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for sh in "16,2048,16,64,128:none:dn" "16,2048,8,128,256:head:gdn"; do
    IFS=: read shape dec nm <<< "$sh"
    timeout 90 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      /tmp/bins/$NEW/recurrence --shape $shape --decay $dec --iterations 1 --forms chunked-kernels --grad seed > $1/all_$nm.csv 2>$1/all_$nm.log
    python3 scripts/kernel_times.py $1/all_$nm.csv --top 40 > $1/all_$nm.txt 2>&1; echo "== ncu all $nm"; cat $1/all_$nm.txt
  done
}
declare -A est=([parity]=40 [ncuall]=25 [mixer]=30 [ncu]=20 [rec]=130 [budget]=110 [fla]=60)
for s in ${STAGES:-parity mixer budget rec}; do
  if [ $(left) -lt ${est[$s]} ]; then echo "=== skip $s ($(left)s left)"; continue; fi
  mkdir -p $W/$s; echo "=== $s at $(( $(date +%s) - t0 ))s"
  st_$s $W/$s 2>&1 | tee $W/$s/out.txt
  pack $s
done
echo "=== end at $(( $(date +%s) - t0 ))s"
