"""py-spy's raw (collapsed) stacks of one thread, summed by function: the share of that thread's samples in which each
function is on the stack (inclusive) and at its top (self). Usage: python by_function.py RAW_FILE [THREAD_SUBSTRING]
(py-spy record --threads -f raw -o RAW_FILE; default thread: MainThread)."""
import collections
import re
import sys

path, want = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "MainThread")
inclusive, top, total = collections.Counter(), collections.Counter(), 0


def name(frame: str) -> str:
    m = re.match(r"(.*) \((.*)\)", frame)
    if not m:
        return frame
    fn, loc = m.groups()
    return f"{fn} ({loc.split(':')[0].split('site-packages/')[-1].split('/work/main/')[-1]})"


for line in open(path):
    stack, n = line.rsplit(" ", 1)
    frames = stack.split(";")
    if want not in frames[0]:
        continue
    n = int(n)
    total += n
    for key in {name(f) for f in frames[1:]}:
        inclusive[key] += n
    top[name(frames[-1])] += n
print(f"{total} samples of {want}")
for title, counter, k in (("inclusive", inclusive, 45), ("self", top, 30)):
    print(f"--- {title}")
    for key, v in counter.most_common(k):
        print(f"{100 * v / total:5.1f}% {key}")
