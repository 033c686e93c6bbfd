"""The router's public listener (geo_router.listener)."""

from __future__ import annotations

from fastapi import FastAPI
from router_harness import router_settings

from geo_router.listener import listener_config
from meridian.http_server import SERVER_KEEPALIVE_S


def test_the_router_outlasts_the_load_balancer_in_front_on_an_idle_connection() -> None:
    # An AWS ALB or GCP load balancer keeps an idle connection 60 s: it, not the router,
    # must close one, or a request it sends as the router closes gets a 502.
    config = listener_config(FastAPI(), router_settings())
    assert config.timeout_keep_alive == SERVER_KEEPALIVE_S > 60
