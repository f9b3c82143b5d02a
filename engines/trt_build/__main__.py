"""``python -m engines.trt_build build MODEL.onnx -o MODEL.plan [options]``."""

from .cli import main

raise SystemExit(main())
