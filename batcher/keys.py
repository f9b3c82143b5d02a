"""Typed keys of the objects the aiohttp application holds."""

from __future__ import annotations

from aiohttp import web

from .config import Config
from .dataplane import DataPlane
from .metrics import Metrics

CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
DATAPLANE = web.AppKey("dataplane", DataPlane)
