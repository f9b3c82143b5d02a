"""The load-testing toolkit: latency against throughput for any KServe v2 HTTP server (ours, Triton, PyTriton,
MLServer), and the parts every bench and test drives load with.

``python -m bench sweep --url URL --model NAME --rates 50,100,200 --duration 10 --out DIR`` runs one step per
offered rate and writes ``DIR/sweep.csv`` and ``DIR/sweep.json`` (the settings and the rows) after every step, then
``DIR/sweep.png`` (latency percentiles against achieved QPS; needs matplotlib, ``pip install -e ".[bench]"``), and
prints the table.

Open loop (default): requests are sent at scheduled times (``constant`` or ``poisson`` arrivals) whatever the
server does, and each latency counts from the request's *scheduled* send time to the last byte of its answer, so
time spent waiting for the server (or for the client) is never left out (no coordinated omission). At most
``--max-inflight`` requests are outstanding; a request that finds the cap reached, or whose send would be more
than ``--max-send-lag-ms`` late, is not sent and is counted as ``client-overload``: the client, not the server,
could not keep up (use ``--processes``). Closed loop (``--mode closed``): ``N`` clients each send a request,
wait for its answer and send the next; the sweep goes over ``--concurrency N1,N2,...`` and latency counts from
the send.

A step's window is ``--duration`` seconds after ``--warmup`` seconds at the same load; requests scheduled (open)
or sent (closed) in the window are its requests, and the step ends when all of them are answered. Achieved QPS
is ``ok / max(duration, last answer - window start)``; percentiles are of the latencies of ``200`` answers
(nearest rank: the smallest latency with at least q % of them at or below it). Average batch size is the delta
of the server's ``batcher_inference_count_total`` / ``batcher_execution_count_total`` (or Triton's
``nv_inference_count`` / ``nv_inference_exec_count``) for the model between the window start and the step's end,
blank where the metrics endpoint does not have them.

The parts (each imported on its own; this package imports nothing):

* :mod:`bench.sweep.arrivals`: open-loop send schedules (constant, Poisson);
* :mod:`bench.sweep.requests`: the one KServe v2 request builder (JSON and binary tensors, BYTES too), the response
  decoder, the inputs to send (from model metadata or the command line) and the HTTP addresses;
* :mod:`bench.sweep.drivers`: the open-loop and the closed-loop driver (async, any ``send()``), the HTTP
  ``send()``, and client processes that share a step;
* :mod:`bench.sweep.report`: statistics of a step (nearest-rank percentiles, errors by status, batch sizes from
  Prometheus text), the sweep's CSV/JSON/PNG and the tables and CSV files of the other benches;
* :mod:`bench.sweep.run`: a sweep's steps (:class:`~bench.sweep.run.SweepConfig`, :func:`~bench.sweep.run.run_sweep`);
* :mod:`bench.sweep.cli`: ``python -m bench sweep``'s options and main, and :func:`~bench.sweep.cli.sweep_subprocess`
  for benches that run it as a command.

Tested in ``tests/unit/test_sweep_parts.py`` (the parts, the drivers against fake servers, the CLI without matplotlib)
and ``tests/integration/test_sweep.py`` (sweeps against a real server).
"""
