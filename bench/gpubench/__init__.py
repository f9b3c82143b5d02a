"""The parts of ``python -m bench.gpu_bench`` (see its docstring): :mod:`.raw` (a), :mod:`.runner` (b),
:mod:`.http` (c), :mod:`.memory` (d), and what they share (:mod:`.common`)."""
