#!/usr/bin/env bash
# a fifteenth session's lease: the tree after executor.py's split (batch_steps.py, device_pipeline.py): tests/gpu,
# then part m runs with the CPU probe of the fourteenth session before each and at the end
# It ran the loop now kept once in bench/results/gpu_scale/lease_part_m.sh, with these arguments:
exec bash bench/results/gpu_scale/lease_part_m.sh l1 380 120 9
