"""Monitoring (Phase 5): an engine's Prometheus metrics and the logger that updates them."""
