#!/usr/bin/env bash
# lease 4: new (this tree, 8 staging slots for resnet18) against base (.ab/base: 9fdc398, 4 slots), traced
# (BATCHER_BATCH_TRACE), ABAB, each run's trace summarized by this tree's bench.gpubench.trace
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res; rm -rf $R; mkdir -p $R; T0=$(date +%s)
{ nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $R/machine.txt 2>&1
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  ( cd $dir && BATCHER_BATCH_TRACE=$R/$name/trace timeout 150 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ) ; echo "rc=$?"
  grep -E "\(m\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/; s/'queue_ms_per_request': [0-9.]*, //; s/'frontends': 8, //" | cut -c1-220
  timeout 60 python3 -m bench.gpubench.trace $R/$name/trace --out $R/$name 2>&1 | tail -3 | cut -d'|' -f2,6,8,9,10,11,18,19
  rm -rf $R/$name/trace
}
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
run new1 . $M; run base1 .ab/base $M; run new2 . $M
[ $(( $(date +%s) - T0 )) -lt 250 ] && run base2 .ab/base $M
tar czf $OUT/l4.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
