#!/usr/bin/env bash
# a fourteenth session's lease 2: the final tree (server.cuda_blocking_sync off, the system-shm read path), tests/gpu,
# then part m runs with the CPU probe (probe.py) before each and at the end: does the host slow down over a lease?
# It ran the loop now kept once in bench/results/gpu_scale/lease_part_m.sh, with these arguments:
exec bash bench/results/gpu_scale/lease_part_m.sh l2 350 90 9
