"""Inference backends behind one engine contract (see :mod:`engines.base`).

``engines`` knows nothing of the HTTP service: it never imports :mod:`batcher`.
"""
