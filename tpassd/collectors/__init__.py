"""tpassd collectors: one module per health source behind collectors.base.Collector."""

from tpassd.collectors.base import Collector, CollectorResult, ComponentReading, run_collector

__all__ = ["Collector", "CollectorResult", "ComponentReading", "run_collector"]
