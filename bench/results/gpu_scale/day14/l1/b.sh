#!/usr/bin/env bash
# lease 1, call b: part p (per-thread CPU at saturation, system shm, no py-spy) with server.cuda_blocking_sync off
# and on, the engine process alone again, then more part m pairs, interleaved
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res_b; rm -rf $R; mkdir -p $R; T0=$(date +%s)
run() {  # name args...
  local name=$1; shift
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  timeout 100 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ; echo "rc=$?"
  grep -E "\(m\) \{|\(p\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/; s/'queue_ms_per_request': [0-9.]*, //; s/'frontends': 8, //" | cut -c1-220
}
P="--parts r,p --frontends 8 --duration 8 --raw-seconds 0.3 --profile-transport shm --py-spy /nonexistent"
run p_spin $P; run p_block $P --cuda-blocking-sync
E="--model resnet18 --kind gpu --drivers 8 --concurrency 64 --duration 5 --warmup 2 --transport shm"
for b in "--cuda-blocking-sync" ""; do
  n=eipc_shm${b:+_block}_2; echo "== $n $(date +%T)"
  timeout 60 python3 -m bench.engine_ipc $E $b --out $R/$n.csv > $R/$n.log 2>&1; echo "rc=$?"; tail -1 $R/$n.log | cut -c1-330
done
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in 6 7 8 9; do
  [ $(( $(date +%s) - T0 )) -lt 470 ] && run block$i $M --cuda-blocking-sync
  [ $(( $(date +%s) - T0 )) -lt 510 ] && run spin$i $M
done
tar czf $OUT/b.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
