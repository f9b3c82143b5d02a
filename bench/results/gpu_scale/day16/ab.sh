#!/usr/bin/env bash
# the same lease: part m on the tree before this session (065d8fa, unpacked in .ab/base16) and on this session's
# tree, interleaved, to tell a change of the code from a change of the host
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res_ab; rm -rf $R; mkdir -p $R; T0=$(date +%s); HERE=$(pwd)
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in 1 2 3 4 5 6; do
  for t in base new; do
    [ $(( $(date +%s) - T0 )) -lt 480 ] || break 2
    d=$HERE; [ $t = base ] && d=$HERE/.ab/base16
    mkdir -p $R/${t}_$i; echo "== ${t}_$i $(date +%T)"
    (cd $d && timeout 100 python3 -m bench.gpu_scale --out $R/${t}_$i $M > $R/${t}_$i/run.log 2>&1); echo "rc=$?"
    grep -E "\(m\) \{" $R/${t}_$i/run.log | grep -o "'transport': '[a-z ]*'\|'qps': [0-9.]*\|'over_raw': [0-9.]*" | tr '\n' ' '; echo
  done
done
tar czf $OUT/ab.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
