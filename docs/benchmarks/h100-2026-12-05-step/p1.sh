#!/bin/bash
# Where a recovery step's time goes with every block's graph kept: ncu (time only) over one
# DeltaNet 1.3B step, --recompute none, of the build in .dev/b4 (ob5); results in $OUT.
set -u
source .dev/calls/setup4.sh
R=$O; mkdir -p $R/p
d=/tmp/bund_ob5; mkdir -p $d/shared/data; cp -r .dev/common/whl .dev/common/tokenizer $d/; cp -r .dev/common/shared/data/calib $d/shared/data/
xz -0 -T0 -c /tmp/bins/ob5/statecut > $d/statecut.xz
M=delta_net_1p3b
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); BS=16; [ $MEM -lt 100000 ] && BS=12
nvidia-smi --query-gpu=name --format=csv,noheader; echo "batch $BS"
RECOVER_REFERENCE=0 RECOVER_STEPS=3 RECOVER_BATCH=$BS RECOVER_ARGS="--recompute none" bash scripts/gpu_bench.sh $d $R/p/x recover:$M > $R/p/recover.log 2>&1
grep -E "statecut after" $R/p/recover.log
CK=/tmp/ck; ls $CK
NCU="/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base"
D=$d/shared/data/calib/wiki.jsonl
timeout 330 $NCU /tmp/bins/ob5/statecut recover -m $CK/$M-rp50 --teacher $CK/$M --data $D --steps 1 --batch-size $BS --seqlen 2048 \
  --warmup 0 --device cuda --dtype bf16 --recompute none -q -o $CK/ncu-rec > $R/p/ncu_rec.csv 2> $R/p/ncu.err
echo "ncu rc $? at $(( $(date +%s) - t0 ))s"; tail -3 $R/p/ncu.err
python3 scripts/kernel_times.py $R/p/ncu_rec.csv --top 60 --json $R/p/ncu_rec_summary.json | tee $R/p/ncu_rec.txt | head -75
xz -9 $R/p/ncu_rec.csv; cp $R/p/x/recover_statecut_*.json $R/p/ 2>/dev/null; rm -rf $R/p/x
