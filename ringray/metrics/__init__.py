"""Prometheus metrics: the catalog (every name, in one place) and the controller's exporter.

    from ringray.metrics import CATALOG, JobMetrics, MetricsOptions, metric
"""

from ringray.metrics.catalog import CATALOG, metric
from ringray.metrics.exporter import JobMetrics, MetricsOptions

__all__ = ["CATALOG", "JobMetrics", "MetricsOptions", "metric"]
