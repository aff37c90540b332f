"""Helpers for tests and benchmarks that are not part of the serving path.

* :mod:`flashpoint.testing.harness` — :class:`~flashpoint.testing.harness.ClusterFactory`, the
  suite's one way to start a cluster (the ``make_cluster`` fixture): in-process or over network
  namespaces behind one API, stopped and leak-checked at the end of each test.
* :mod:`flashpoint.testing.leaks` — what a cluster may leave behind (processes, asyncio tasks,
  listening sockets), found from /proc and the event loop.
* :mod:`flashpoint.testing.netns` — :class:`~flashpoint.testing.netns.NetLab`, a lab of test
  hosts in Linux network namespaces joined by a bridge, with per-link rate caps (root only).
* :mod:`flashpoint.testing.netcluster` — a cluster of real processes in a NetLab.
"""
