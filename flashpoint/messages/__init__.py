"""Typed RPC messages, one module per pair of peers (STYLE §6).

``base`` holds :class:`Message` and the two edge functions every module's types go through:
:func:`to_payload` when a message leaves a process and :func:`from_payload` when one arrives.
The peer modules (``controller_host``, ``controller_worker``, ``host_worker``,
``gateway_controller``; KaaS executors' calls are controller_worker messages) define one Struct
per request and reply. Nothing outside this package and the handler edge reads a payload
dict by key.
"""
