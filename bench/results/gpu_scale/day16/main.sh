#!/usr/bin/env bash
# a sixteenth session's lease: the tree with the heartbeat (batcher/heartbeat.py), the front end's deadline backstop
# and Triton's preferred_batch_size rule: tests/gpu, then part m runs with 8 front ends, the CPU probe between them
# It ran the loop now kept once in bench/results/gpu_scale/lease_part_m.sh, with these arguments:
exec bash bench/results/gpu_scale/lease_part_m.sh l1 430 150 10
