#!/bin/bash
# One call: parity of the quad build; the recurrence alone for main (ob5), prefetch (pf) and
# prefetch + quads (q) taking turns; per-kernel times under ncu for each. Results in $OUT/*.tgz.
set -u
source .dev/calls/setup6.sh
R=$O; W=/tmp/res; mkdir -p $W
LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
pack() { tar -czf $R/$1.tgz -C $W/$1 . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
st_parity() {
  timeout 150 /tmp/bins/q/gpu_parity --test-threads 1 > $1/parity.log 2>&1; rc=$?
  echo "parity q rc $rc"; grep -E "test result" $1/parity.log; grep -E "FAILED|panicked" $1/parity.log | head -5
}
mixer() {
  for s in "16,2048,16,64,128 none" "16,2048,8,128,256 head"; do
    set -- $s
    for b in $builds; do
      /tmp/bins/$b/recurrence --shape $1 --decay $2 --iterations 5 --forms chunked-kernels --grad seed 2>>$W/mixer/mixer.log \
        | sed "s/^{/{\"build\":\"$b\",/" | tee -a $W/mixer/mixer.jsonl | python3 -c 'import json,sys
for l in sys.stdin: r=json.loads(l); print(r["build"], r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))'
    done
  done
}
st_mixer() { builds="ob5 pf q"; mixer; builds="q pf ob5"; mixer; }
st_ncu() {
  local NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for b in ob5 pf q; do
    for sh in "16,2048,16,64,128:none:dn" "16,2048,8,128,256:head:gdn"; do
      IFS=: read shape dec nm <<< "$sh"
      timeout 60 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base -k regex:'chunk_|_chunks' \
        /tmp/bins/$b/recurrence --shape $shape --decay $dec --iterations 1 --forms chunked-kernels --grad seed > $1/t_${b}_$nm.csv 2>$1/t_${b}_$nm.log
      python3 scripts/kernel_times.py $1/t_${b}_$nm.csv --top 14 > $1/t_${b}_$nm.txt 2>&1; echo "== ncu $b $nm"; sed -n '/top/,$p' $1/t_${b}_$nm.txt
    done
  done
}
declare -A est=([parity]=120 [mixer]=150 [ncu]=150)
for s in ${STAGES:-parity mixer ncu}; do
  if [ $(left) -lt ${est[$s]} ]; then echo "=== skip $s ($(left)s left)"; continue; fi
  mkdir -p $W/$s; echo "=== $s at $(( $(date +%s) - t0 ))s"
  st_$s $W/$s 2>&1 | tee $W/$s/out.txt
  pack $s
done
echo "=== end at $(( $(date +%s) - t0 ))s"
