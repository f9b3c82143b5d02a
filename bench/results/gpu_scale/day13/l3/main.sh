#!/usr/bin/env bash
# lease 3: tests/gpu on this tree ("new": staging_slots_for, 8 slots for resnet18), then part m of new against
# the code before (.ab/base: git archive of HEAD 9fdc398, 4 slots), interleaved; part n of new if time is left
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res; rm -rf $R; mkdir -p $R; T0=$(date +%s)
{ nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $R/machine.txt 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu > $R/gpu_tests.txt 2>&1; echo "tests/gpu rc=$?"; tail -2 $R/gpu_tests.txt
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  ( cd $dir && timeout 150 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ) ; echo "rc=$?"
  grep -E "\(m\) \{|\(n\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/; s/'queue_ms_per_request': [0-9.]*, //; s/'frontends': 8, //" | cut -c1-220
}
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
run new1 . $M; run base1 .ab/base $M; run new2 . $M; run base2 .ab/base $M; run new3 . $M; run base3 .ab/base $M
[ $(( $(date +%s) - T0 )) -lt 420 ] && run new4 . $M
[ $(( $(date +%s) - T0 )) -lt 460 ] && run base4 .ab/base $M
[ $(( $(date +%s) - T0 )) -lt 480 ] && run n_new . --parts r,n --frontends 1,2,4,8 --duration 8 --raw-seconds 0.3
tar czf $OUT/l3.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
