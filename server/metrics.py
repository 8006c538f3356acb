"""Prometheus metrics (placeholder until implemented)."""


def add_routes(app, tm) -> None:
    pass
