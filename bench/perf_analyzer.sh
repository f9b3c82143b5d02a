#!/usr/bin/env bash
# Triton's perf_analyzer (2.51) against a running KServe v2 server on 127.0.0.1, installed on first use.
#
#   bench/perf_analyzer.sh [options] MODEL PORT [-- more perf_analyzer options]
#
#   -v VENV   virtualenv holding perf_analyzer (default: $PA_VENV or /tmp/pa-venv); made and filled if it lacks
#             bin/perf_analyzer: tritonclient[http]==2.51.0 (whose wheel ships the perf_analyzer binary) and
#             nvidia-cuda-runtime-cu12 (libcudart.so.12, which the binary links even without a GPU). Kept apart
#             from the project's virtualenv so that one keeps its own tritonclient.
#   -c RANGE  --concurrency-range (default: 1:8:1)
#   -t MS     --measurement-interval in ms (default: 5000)
#   -i        install only, run nothing
#   PYTHON    the Python that makes the virtualenv (default: python3)
#
# The binary also needs Debian's libb64-0d (libb64.so.0d): installed with apt-get when missing (as root).
# perf_analyzer reads GET /v2/models/MODEL and /v2/models/MODEL/config, sends binary tensors over HTTP and
# reads the statistics extension (GET /v2/models/MODEL/stats) for its server-side columns.
#
# examples:
#   python -m batcher serve --port 8000 &                  # default config: tiny_cnn, resnet18, ...
#   bench/perf_analyzer.sh tiny_cnn 8000
#   bench/perf_analyzer.sh -c 1:16:4 -t 3000 resnet18 8000 -- --percentile=99 -f out.csv
set -euo pipefail

venv="${PA_VENV:-/tmp/pa-venv}"
range="1:8:1"
interval=5000
install_only=0
usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }
while getopts "v:c:t:ih" opt; do
  case "$opt" in
    v) venv="$OPTARG" ;;
    c) range="$OPTARG" ;;
    t) interval="$OPTARG" ;;
    i) install_only=1 ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))

if [ ! -x "$venv/bin/perf_analyzer" ]; then
  echo "installing perf_analyzer 2.51 into $venv" >&2
  [ -x "$venv/bin/pip" ] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q "tritonclient[http]==2.51.0" nvidia-cuda-runtime-cu12
fi
if ! ldconfig -p | grep -q 'libb64\.so\.0d'; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing Debian's libb64-0d" >&2
    (apt-get install -y -q libb64-0d || { apt-get update -q && apt-get install -y -q libb64-0d; }) >&2
  else
    echo "perf_analyzer needs libb64.so.0d: run 'sudo apt-get install -y libb64-0d'" >&2
    exit 1
  fi
fi
cudart="$("$venv/bin/python" -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')"
export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$venv/bin/perf_analyzer" --version >&2
[ "$install_only" = 1 ] && exit 0

if [ $# -lt 2 ]; then
  usage >&2
  exit 2
fi
model="$1"
port="$2"
shift 2
[ "${1:-}" = "--" ] && shift
set -x
exec "$venv/bin/perf_analyzer" -m "$model" -u "127.0.0.1:$port" -i http \
  --concurrency-range "$range" --measurement-interval "$interval" "$@"
