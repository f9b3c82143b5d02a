#!/usr/bin/env bash
# lease 1: per-batch traces of part m, base tree (.) and depth-3 tree (.ab/d3) in turn
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res; rm -rf $R; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; } > $R/machine.txt 2>&1
cat $R/machine.txt
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  echo "== $name $(date +%T)"
  ( cd $dir && BATCHER_BATCH_TRACE=$R/$name/trace timeout 150 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ) ; echo "rc=$?"
  grep -E "\(m\) \{|\(p\) [0-9]" $R/$name/run.log | sed -e "s/'errors_by_status': '', //" | cut -c1-330
  ( cd $dir && timeout 60 python3 -m bench.gpubench.trace $R/$name/trace --out $R/$name ) 2>&1 | tail -3
}
mkdir -p $R/base1 $R/d3_1 $R/base2 $R/d3_2 $R/base3 $R/d3_3 $R/p_shm
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
run base1 . $M
run d3_1 .ab/d3 $M
run base2 . $M
run d3_2 .ab/d3 $M
run base3 . $M
run d3_3 .ab/d3 $M
run p_shm . --parts r,p --profile-transport shm --frontends 8 --duration 8 --raw-seconds 0.3 --py-spy /tmp/site/bin/py-spy
rm -rf $R/*/trace/*.raw 2>/dev/null
tar czf $OUT/l1.tgz -C $R .
ls -la $OUT
