#!/usr/bin/env bash
# the same lease as l3, its next call: part m of this tree, the base tree, this tree (ABA), traced
source .gpu/bin/install.sh >/dev/null 2>&1; R=/tmp/res4; mkdir -p $R
for x in new4:. base4:.ab/base new5:.; do n=${x%%:*}; d=${x#*:}; mkdir -p $R/$n
  (cd $d && BATCHER_BATCH_TRACE=$R/$n/trace timeout 100 python3 -m bench.gpu_scale --out $R/$n --parts r,m --frontends 8 --duration 8 --raw-seconds 0.3 > $R/$n/run.log 2>&1
   timeout 30 python3 -m bench.gpubench.trace $R/$n/trace --out $R/$n > /dev/null 2>&1); done
tar czf $OUT/l4.tgz -C $R .
