#!/usr/bin/env bash
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
rm -rf /tmp/res; mkdir -p /tmp/res
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
S=.gpu/bin/s.sh
P="--parts r,p --frontends 8 --duration 8 --raw-seconds 0.3"
E="python3 -m bench.engine_ipc --model resnet18 --kind gpu --drivers 8 --concurrency 64 --event-loop uvloop --duration 6 --warmup 2"
for i in 1; do
  S_LIMIT=100 bash $S p_bin$i $P --profile-transport binary | grep -v "^\s*$"
  S_LIMIT=100 bash $S p_shm$i $P --profile-transport shm | grep -v "^\s*$"
  timeout 90 $E --out /tmp/res/eipc$i.csv > /tmp/res/eipc$i.log 2>&1; tail -1 /tmp/res/eipc$i.log
  for d in p_bin$i p_shm$i; do head -8 /tmp/res/$d/scale_p_threads.md; done
  tar czf "$OUT"/res.tgz -C /tmp/res .
done
