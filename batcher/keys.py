"""Typed keys of the objects the aiohttp application holds."""

from __future__ import annotations

from aiohttp import web

from .config import Config
from .metrics import Metrics
from .registry import Registry

CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
REGISTRY = web.AppKey("registry", Registry)
