"""Helpers for tests and benchmarks that are not part of the serving path.

* :mod:`flashpoint.testing.netns` — :class:`~flashpoint.testing.netns.NetLab`, a lab of test
  hosts in Linux network namespaces joined by a bridge, with per-link rate caps (root only).
"""
