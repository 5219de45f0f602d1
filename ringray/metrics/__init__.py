"""Prometheus metrics: the catalog (every name, in one place) and the controller's exporter.

    from ringray.metrics.catalog import CATALOG, metric
"""
