#!/usr/bin/env bash
# lease 2: CudaGraphContext.staging_slots 6 and 8 (.ab/s6, .ab/s8: copies of this tree with that one line changed)
# against this tree (4), part m, interleaved
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res; rm -rf $R; mkdir -p $R; T0=$(date +%s)
{ nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $R/machine.txt 2>&1
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  ( cd $dir && timeout 150 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ) ; echo "rc=$?"
  grep -E "\(m\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/; s/'queue_ms_per_request': [0-9.]*, //; s/'frontends': 8, //" | cut -c1-220
}
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
run s6_1 .ab/s6 $M; run base1 . $M; run s8_1 .ab/s8 $M; run s6_2 .ab/s6 $M; run base2 . $M; run s8_2 .ab/s8 $M
[ $(( $(date +%s) - T0 )) -lt 470 ] && run s6_3 .ab/s6 $M
[ $(( $(date +%s) - T0 )) -lt 510 ] && run base3 . $M
tar czf $OUT/l2.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
