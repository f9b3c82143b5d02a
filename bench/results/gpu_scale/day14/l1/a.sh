#!/usr/bin/env bash
# lease 1, call a: tests/gpu (the blocking-sync test and the graph contexts), the engine process alone
# (bench.engine_ipc, resnet18 on the GPU, inputs in the shared area or in system shm) with server.cuda_blocking_sync
# off and on, then part m with it off ("spin") and on ("block"), interleaved
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
R=/tmp/res_a; rm -rf $R; mkdir -p $R; T0=$(date +%s)
{ nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Thread|Core|Socket|Model name"; } > $R/machine.txt 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "blocking or matches_cpu_at_every or launched_before" > $R/gpu_tests.txt 2>&1; echo "tests/gpu rc=$?"; tail -2 $R/gpu_tests.txt
E="--model resnet18 --kind gpu --drivers 8 --concurrency 64 --duration 5 --warmup 2"
for t in shm area; do for b in "" "--cuda-blocking-sync"; do
  n=eipc_${t}${b:+_block}; echo "== $n $(date +%T)"
  timeout 60 python3 -m bench.engine_ipc $E --transport $t $b --out $R/$n.csv > $R/$n.log 2>&1; echo "rc=$?"; tail -1 $R/$n.log | cut -c1-330
done; done
run() {  # name args...
  local name=$1; shift
  mkdir -p $R/$name; echo "== $name $(date +%T)"
  timeout 100 python3 -m bench.gpu_scale --out $R/$name "$@" > $R/$name/run.log 2>&1 ; echo "rc=$?"
  grep -E "\(m\) \{|batch 32" $R/$name/run.log | sed -e "s/'errors_by_status': '', //; s/'p50_ms.*'queue_ms/'queue_ms/; s/'machine_busy_cores.*'raw_rows/'raw_rows/; s/'queue_ms_per_request': [0-9.]*, //; s/'frontends': 8, //" | cut -c1-220
}
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in 1 2 3 4 5; do
  [ $(( $(date +%s) - T0 )) -lt 470 ] && run spin$i $M
  [ $(( $(date +%s) - T0 )) -lt 510 ] && run block$i $M --cuda-blocking-sync
done
tar czf $OUT/a.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
