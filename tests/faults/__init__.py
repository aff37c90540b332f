"""Fault tests (issue 6, item 5).

Here: hypothesis fuzzing of every decoder that faces the network (the gateway's routes through
the real aiohttp app, RPC frames and the handshake, activation frames, data-plane headers):
no crash, no 500, typed errors only. The kill tests need real processes and so live beside
the clusters they kill:

- relays: ``tests/netns/test_cluster_netns.py::test_relay_killed_mid_stream_survivors_end_identical``
  (and the corrupted-chunk repair test) — every cached byte hashed against the registry;
- hosts: ``tests/cluster/test_serving.py::test_lost_host_replicas_are_replaced``;
- workers: ``tests/cluster/test_worker_failure.py`` (SIGKILL under load, no request lost);
- the controller: ``tests/netns/test_cluster_netns.py`` — SIGKILL and restart (no function
  lost, replicas adopted, none duplicated) and the same under load through a stand-alone
  gateway (every request answered correctly);
- evictions under load: ``tests/cluster/test_eviction.py`` (no request lost, models survive in
  a peer's RAM) and ``bench/soak.py``.
"""
