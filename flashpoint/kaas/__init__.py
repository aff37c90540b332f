"""Kernel-as-a-Service: GPU-only functions as kernel graphs over a pool-wide buffer cache.

Modules::

    spec       KaasRequest / KernelSpec / BufferSpec (versioned, from_dict / to_dict)
    graph      plan_graph: validation (typed 400s) and kernel order; cache keys
    library    registered kernels (torch operators; raw CuPy/Triton via raw.py on GPUs)
    store      immutable key -> bytes object store (in-process RAM for now)
    cache      BufferCache: single-use LRU, then multi-use LRU, pins
    executor   Executor: resident -> kernels -> d2h over device and host caches
    pool       ExecutorPool: pull-based dispatch through policy/kaas.py
    service    KaasService: what the gateway calls; local_service() builds one in process
"""
