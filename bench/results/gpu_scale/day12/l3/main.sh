#!/usr/bin/env bash
# lease 3: tests/gpu on this tree; part m of this tree ("new": page_locked's last range, parts' addresses kept)
# against the lease-1 base (.ab/base) in turn ABBAAB, traced; then part n on this tree
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res; rm -rf $R; mkdir -p $R; T0=$(date +%s)
{ nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $R/machine.txt 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu > $R/gpu_tests.txt 2>&1; echo "tests/gpu rc=$?"; tail -3 $R/gpu_tests.txt
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  ( cd $dir && BATCHER_BATCH_TRACE=$R/$name/trace timeout 150 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ) ; echo "rc=$?"
  grep -E "\(m\) \{|\(n\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/" | cut -c1-260
  ( cd $dir && timeout 60 python3 -m bench.gpubench.trace $R/$name/trace --out $R/$name ) 2>&1 | tail -3 | cut -d'|' -f2,6,11,12,13,14,15,16,17,18,19
}
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
run new1 . $M; run base1 .ab/base $M; run base2 .ab/base $M; run new2 . $M; run new3 . $M; run base3 .ab/base $M
[ $(( $(date +%s) - T0 )) -lt 430 ] && run n_new . --parts r,n --frontends 1,2,4,8 --duration 8 --raw-seconds 0.3
tar czf $OUT/l3.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
