"""Accounting and observability: what each request cost and what the router saw.

A request's usage settled against its tenant's limits and counted (accounting), its access
line (access_log), its span (tracing), and the router's Prometheus metrics (metrics) served
where only scrapers reach them (admin_listener).
"""
