#!/usr/bin/env bash
# One lease's work on the GPU machine: tests/gpu, then part m runs at 8 front ends (binary HTTP and system shm) until
# SECONDS are spent, with the CPU probe (day14/l2/probe.py) before the first and after each, to tell a slower host
# from a slower tree. Run from the project root after the lease's chunks (README "Many front ends, shared memory,
# two GPUs"); the results come back as $OUT/NAME.tgz.
# Usage: bash bench/results/gpu_scale/lease_part_m.sh NAME SECONDS TESTS_TIMEOUT MAX_RUNS
#   TESTS_TIMEOUT: seconds for tests/gpu, 0 to skip them; MAX_RUNS: at most this many part m runs
# The GPU machine lacks pydantic (and orjson): stage their wheels first, e.g. `bash ../shared/gpu/stage.sh
# orjson==3.11.4` and `pip download --no-deps` of pydantic, pydantic-core, annotated-types, typing-inspection and
# typing-extensions for cp312 into .gpu/wheels (the versions of the local venv).
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
python3 -c "import batcher.config, orjson" || { echo "the server does not import: stage the wheels above"; exit 1; }
N=${1:-l1}; BUDGET=${2:-430}; TESTS=${3:-150}; MAX=${4:-20}
R=/tmp/res_$N; rm -rf $R; mkdir -p $R; T0=$(date +%s)
# the probe line also counts the processes left running (a leaked server would slow the later runs)
probe() { echo "probe $1 t=$(( $(date +%s) - T0 ))s $(python3 bench/results/gpu_scale/day14/l2/probe.py) procs=$(ps -e --no-headers | wc -l) batcher=$(pgrep -fc 'batcher serve')" | tee -a $R/probe.txt; }
probe start
if [ "$TESTS" -gt 0 ]; then
  timeout $TESTS python3 -m pytest -q -p no:cacheprovider tests/gpu > $R/gpu_tests.txt 2>&1; echo "tests/gpu rc=$?"; tail -2 $R/gpu_tests.txt
fi
M="--parts r,m --frontends 8 --duration 8 --raw-seconds 0.3"
for i in $(seq 1 $MAX); do
  [ $(( $(date +%s) - T0 )) -lt $BUDGET ] || break
  mkdir -p $R/m$i; echo "== m$i $(date +%T)"
  timeout 100 python3 -m bench.gpu_scale --out $R/m$i $M > $R/m$i/run.log 2>&1; echo "rc=$?"
  grep -E "\(m\) \{" $R/m$i/run.log | grep -o "'transport': '[a-z ]*'\|'qps': [0-9.]*\|'over_raw': [0-9.]*" | tr '\n' ' '; echo
  probe after_m$i
done
tar czf $OUT/$N.tgz -C $R .
echo "elapsed $(( $(date +%s) - T0 )) s"
