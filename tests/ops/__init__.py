"""Helpers of the ops tests (tests/test_ops_*.py): a real Prometheus process,
PromQL and Grafana dashboard readers, paths of deploy/, helm/ and loadtest/."""
