#!/usr/bin/env bash
# a seventeenth session's lease: the tree with the edge wrapper (no aiohttp middleware), the kept JSON parts of
# binary requests (codec._HeaderPlan) and the shorter DataPlane.infer: tests/gpu, then part m runs at 8 front ends
# (binary HTTP and system shm), the CPU probe between them. Usage: bash bench/results/gpu_scale/day17/main.sh NAME SECONDS
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
N=${1:-l1}; BUDGET=${2:-430}
R=/tmp/res_$N; rm -rf $R; mkdir -p $R; T0=$(date +%s)
probe() { echo "probe $1 t=$(( $(date +%s) - T0 ))s $(python3 bench/results/gpu_scale/day14/l2/probe.py)" | tee -a $R/probe.txt; }
probe start
if [ "$N" = l1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu > $R/gpu_tests.txt 2>&1; echo "tests/gpu rc=$?"; tail -2 $R/gpu_tests.txt
fi
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in $(seq 1 20); do
  [ $(( $(date +%s) - T0 )) -lt $BUDGET ] || break
  mkdir -p $R/m$i; echo "== m$i $(date +%T)"
  timeout 100 python3 -m bench.gpu_scale --out $R/m$i $M > $R/m$i/run.log 2>&1; echo "rc=$?"
  grep -E "\(m\) \{" $R/m$i/run.log | grep -o "'transport': '[a-z ]*'\|'qps': [0-9.]*\|'over_raw': [0-9.]*" | tr '\n' ' '; echo
  probe after_m$i
done
tar czf $OUT/$N.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
