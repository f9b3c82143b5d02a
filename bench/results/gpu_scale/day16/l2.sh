#!/usr/bin/env bash
# the same session, a second lease on the tree with the fresh user's fixes: tests/gpu, then part m runs with 8 front
# ends, the CPU probe between them
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res_l2; rm -rf $R; mkdir -p $R; T0=$(date +%s)
probe() { echo "probe $1 t=$(( $(date +%s) - T0 ))s $(python3 bench/results/gpu_scale/day14/l2/probe.py)" | tee -a $R/probe.txt; }
probe start
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu > $R/gpu_tests.txt 2>&1; echo "tests/gpu rc=$?"; tail -2 $R/gpu_tests.txt
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in 1 2 3 4 5 6 7 8 9 10; do
  [ $(( $(date +%s) - T0 )) -lt 400 ] || break
  mkdir -p $R/m$i; echo "== m$i $(date +%T)"
  timeout 100 python3 -m bench.gpu_scale --out $R/m$i $M > $R/m$i/run.log 2>&1; echo "rc=$?"
  grep -E "\(m\) \{" $R/m$i/run.log | grep -o "'transport': '[a-z ]*'\|'qps': [0-9.]*\|'over_raw': [0-9.]*" | tr '\n' ' '; echo
  probe after_m$i
done
tar czf $OUT/l2.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
