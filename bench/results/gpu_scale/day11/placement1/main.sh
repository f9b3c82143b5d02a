#!/usr/bin/env bash
source .gpu/bin/install.sh > /tmp/inst.log 2>&1 || { cat /tmp/inst.log; exit 1; }
rm -rf /tmp/res; mkdir -p /tmp/res
nproc; lscpu | grep -E "Model name|NUMA|Socket|Thread|MHz" ; nvidia-smi topo -m 2>/dev/null | head -5
S=.gpu/bin/s.sh
M="--parts r,m --frontends 8 --duration 8"
S_LIMIT=90 bash $S m_a1 $M
S_LIMIT=90 bash $S m_pin3 $M --engine-cpus 0-2
S_LIMIT=90 bash $S m_nice $M --engine-nice -10
S_LIMIT=90 bash $S m_pin2 $M --engine-cpus 0-1
S_LIMIT=90 bash $S m_a2 $M
S_LIMIT=90 bash $S m_pin3b $M --engine-cpus 0-2
S_LIMIT=90 bash $S m_cp3 $M --client-processes 3
