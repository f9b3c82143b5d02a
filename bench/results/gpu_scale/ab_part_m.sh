#!/usr/bin/env bash
# part m on an older tree (unpacked in .ab/BASE) and on this tree, interleaved, to tell a change of the code from a
# change of the host. Usage: bash bench/results/gpu_scale/ab_part_m.sh BASE SECONDS, from the project root on the GPU
# machine, after the lease's chunks (README "Many front ends, shared memory, two GPUs"); e.g. BASE base17, a
# `git archive` of 47e9109 (the sixteenth session's last commit), carried as .ab/base17
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
B=${1:-base17}; BUDGET=${2:-480}
R=/tmp/res_ab; rm -rf $R; mkdir -p $R; T0=$(date +%s); HERE=$(pwd)
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in $(seq 1 12); do
  for t in base new; do
    [ $(( $(date +%s) - T0 )) -lt $BUDGET ] || break 2
    d=$HERE; [ $t = base ] && d=$HERE/.ab/$B
    mkdir -p $R/${t}_$i; echo "== ${t}_$i $(date +%T)"
    (cd $d && timeout 100 python3 -m bench.gpu_scale --out $R/${t}_$i $M > $R/${t}_$i/run.log 2>&1); echo "rc=$?"
    grep -E "\(m\) \{" $R/${t}_$i/run.log | grep -o "'transport': '[a-z ]*'\|'qps': [0-9.]*\|'over_raw': [0-9.]*" | tr '\n' ' '; echo
  done
done
tar czf $OUT/ab.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
