#!/usr/bin/env bash
# the same session, a second lease on the tree with the fresh user's fixes: tests/gpu, then part m runs with 8 front
# ends, the CPU probe between them
# It ran the loop now kept once in bench/results/gpu_scale/lease_part_m.sh, with these arguments:
exec bash bench/results/gpu_scale/lease_part_m.sh l2 400 150 10
