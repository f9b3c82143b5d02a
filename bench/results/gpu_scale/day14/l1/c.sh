#!/usr/bin/env bash
# lease 1, call c: part n (1 / 2 / 4 / 8 front ends) on this tree as it is (cuda_blocking_sync off), then more
# part m runs of it while time is left
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res_c; rm -rf $R; mkdir -p $R; T0=$(date +%s)
run() {  # name args...
  local name=$1; shift
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  timeout 200 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ; echo "rc=$?"
  grep -E "\(m\) \{|\(n\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/; s/'queue_ms_per_request': [0-9.]*, //; s/'frontends': 8, //" | cut -c1-220
}
run n --parts r,n --frontends 1,2,4,8 --duration 8 --raw-seconds 0.3
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in 10 11 12 13 14 15; do [ $(( $(date +%s) - T0 )) -lt 450 ] && run spin$i $M; done
tar czf $OUT/c.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
