#!/usr/bin/env bash
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
rm -rf /tmp/res; mkdir -p /tmp/res
S=.gpu/bin/s.sh
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
st() { awk '/^cpu /{print $9}' /proc/stat; }
for spec in "a3|" "nice2|--engine-nice -10" "pin3c|--engine-cpus 0-2" "a4|" "nice3|--engine-nice -10" "pin3d|--engine-cpus 0-2" "a5|" "nice4|--engine-nice -10"; do
  n="${spec%%|*}"; x="${spec#*|}"
  s0=$(st); t0=$(date +%s.%N)
  S_LIMIT=90 bash $S $n $M $x | grep -o "^== .*\|'transport': '[a-z ]*'\|'qps': [0-9.]*\|'device_busy_share': [0-9.]*" | tr '\n' ' '
  s1=$(st); t1=$(date +%s.%N)
  echo " steal_cores=$(python3 -c "print(round(($s1-$s0)/100/($t1-$t0),2))")" | tee -a /tmp/res/steal.txt
  echo "$n steal_cores=$(python3 -c "print(round(($s1-$s0)/100/($t1-$t0),2))")" >> /tmp/res/steal_by_run.txt
  tar czf "$OUT"/res.tgz -C /tmp/res .
done
