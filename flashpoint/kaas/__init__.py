"""Kernel-as-a-Service: GPU-only functions as kernel graphs over a pool-wide buffer cache.

Modules::

    spec       KaasRequest / KernelSpec / BufferSpec (versioned, from_dict / to_dict)
    graph      plan_graph: validation (typed 400s) and kernel order; cache keys
    library    registered kernels (torch operators; raw CuPy/Triton via raw.py on GPUs)
    raw        CuPy (source/PTX) and Triton kernels, registered only where usable
    backend    KaasResult and the KaasBackend protocol the gateway calls (no torch)
    store      immutable key -> bytes object store (in-process RAM for now)
    cache      BufferCache: single-use LRU, then multi-use LRU, pins
    executor   Executor: resident -> kernels -> d2h over device and host caches
    pool       ExecutorPool: pull-based dispatch through policy/kaas.py
    service    KaasService: what the gateway calls; local_service() builds one in process

    remote     WorkerKaasRuntime (a worker's executor) and WorkerExecutorHandle (the
               controller's handle over its RPC connection; ships inputs the worker lacks)

In a cluster the controller keeps the object store and deploys ``[controller] kaas_workers``
KaaS executor replicas (reserved function name :data:`KAAS_FUNCTION`) through the normal
placement path; ``controller/kaas_pool.py`` turns them into the pool behind ``/v1/kaas``.
``local_service`` still builds an in-process pool (tests, ``bench/kaas.py``).
"""

# The reserved function name of KaaS executor replicas: not a valid user function name
# (names start with a letter or digit), so it never collides with a registered function.
KAAS_FUNCTION = "_kaas"
