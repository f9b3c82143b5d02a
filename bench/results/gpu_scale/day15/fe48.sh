#!/usr/bin/env bash
# the same lease: part m with 4 front ends against 8, interleaved: does system shm gain when fewer front ends
# share the 16 cores with the engine process?
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res_fe; rm -rf $R; mkdir -p $R; T0=$(date +%s)
for i in 1 2 3 4 5; do
  for n in 4 8; do
    [ $(( $(date +%s) - T0 )) -lt 400 ] || break 2
    mkdir -p $R/f${n}_$i; echo "== f${n}_$i $(date +%T)"
    timeout 100 python3 -m bench.gpu_scale --out $R/f${n}_$i --parts r,m --frontends $n --duration 8 --raw-seconds 0.3 \
      > $R/f${n}_$i/run.log 2>&1; echo "rc=$?"
    grep -E "\(m\) \{" $R/f${n}_$i/run.log | grep -o "'transport': '[a-z ]*'\|'qps': [0-9.]*\|'over_raw': [0-9.]*" | tr '\n' ' '; echo
  done
done
tar czf $OUT/fe.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
