#!/bin/bash
# CPU of each thread of a running server's process tree (and of h2load's threads: cores on CPU and cores waiting
# in the run queue, from /proc/<pid>/task/<tid>/schedstat) over an open-loop h2load step sent the way bench.peers
# sends it (bench/sweep/h2load.py: one connection per 50 ms of sends, connections started ~1/rate apart).
# usage: threads.sh PID PORT RATE SECONDS BODY_FILE JSON_LENGTH
#   PID: the server's process (`python -m batcher serve ...`), PORT its HTTP port, RATE req/s, BODY_FILE a
#   binary-extension request for model mlp (bench.peers.mlp_requests()["binary"]), JSON_LENGTH its JSON part's bytes.
set -eu
PID=$1 PORT=$2 RATE=$3 S=$4 BODY=$5 JLEN=$6
CONNS=$(python3 -c "import math;print(max(1,min(512,math.ceil($RATE*0.05))))")
tids() { for p in $PID $(pgrep -P $PID || true) $(for c in $(pgrep -P $PID || true); do pgrep -P $c || true; done) $(pgrep -x h2load || true); do
           for t in /proc/$p/task/*; do echo "$p/$(basename $t) $(cat /proc/$p/comm) $(cat $t/schedstat)"; done; done 2>/dev/null; }
h2load --h1 -d "$BODY" -H "Inference-Header-Content-Length: $JLEN" -H 'Content-Type: application/octet-stream' \
  -c $CONNS --rps $(python3 -c "print($RATE/$CONNS)") -r $(python3 -c "print(max(1,round($RATE/1000)))") \
  --rate-period 1ms -n $((RATE*S)) http://127.0.0.1:$PORT/v2/models/mlp/infer > /tmp/threads_h2load.out 2>&1 &
H=$!
sleep 1; tids > /tmp/threads_a; T1=$(date +%s.%N)
sleep $((S-2)); tids > /tmp/threads_b; T2=$(date +%s.%N)
wait $H
grep -E "^finished|^requests:" /tmp/threads_h2load.out
python3 - "$T1" "$T2" <<'P'
import sys
t = float(sys.argv[2]) - float(sys.argv[1])
read = lambda f: {l.split()[0]: (l.split()[1], list(map(int, l.split()[2:5]))) for l in open(f) if len(l.split()) == 5}
a, b = read("/tmp/threads_a"), read("/tmp/threads_b")
print(f"  {'pid/tid':14s} {'process':14s} {'on cpu':>8s} {'run queue':>10s}  (cores)")
for k, (comm, v) in b.items():
    if k in a:
        cpu, wait = (v[0] - a[k][1][0]) / 1e9 / t, (v[1] - a[k][1][1]) / 1e9 / t
        if cpu > 0.01:
            print(f"  {k:14s} {comm:14s} {cpu:8.2f} {wait:10.3f}")
P
