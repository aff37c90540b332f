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

First cut: executors run in the process that builds the service (enable the routes with
``gateway.add_routes(..., kaas=local_service(...))``; the controller does not yet). The pool
reaches executors only through ``pool.ExecutorHandle``, and ``Executor.run_wire`` is the
plain-data entry point for a worker RPC handler; executors in GPU worker processes also
need an object store they can reach (registry/S3-backed), which is the next step.
"""
