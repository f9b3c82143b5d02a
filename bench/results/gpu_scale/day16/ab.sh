#!/usr/bin/env bash
# the sixteenth session's lease: part m on the tree before it (065d8fa, unpacked in .ab/base16) and on its tree,
# interleaved, to tell a change of the code from a change of the host. It ran this loop, now kept once in
# bench/results/gpu_scale/ab_part_m.sh (6 pairs fit its 480 s):
exec bash bench/results/gpu_scale/ab_part_m.sh base16 480
