#!/usr/bin/env bash
# lease 1 of the thirteenth session: the code at HEAD as it is (no trace), part m five times, then part p
# (system shared memory, py-spy) and part n
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res; rm -rf $R; mkdir -p $R; T0=$(date +%s)
{ nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --format=%h 2>/dev/null; } > $R/machine.txt 2>&1
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  ( cd $dir && timeout 150 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ) ; echo "rc=$?"
  grep -E "\(m\) \{|\(n\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/" | cut -c1-260
}
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in 1 2 3 4 5; do run m$i . $M; done
run p_shm . --parts r,p --frontends 8 --duration 8 --raw-seconds 0.3 --profile-transport shm --py-spy /tmp/site/bin/py-spy
[ $(( $(date +%s) - T0 )) -lt 480 ] && run n . --parts r,n --frontends 1,2,4,8 --duration 8 --raw-seconds 0.3
tar czf $OUT/l1.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
