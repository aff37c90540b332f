"""GPU discovery and sharing.

- ``inventory``: ``discover()``, the host's device list (GPUs, else CPU placement units).
- ``nvml``: the ``Nvml`` adapter protocol (pynvml itself satisfies it) and the read-only
  inventory of GPUs, MIG mode, GPU/compute instances and MIG devices.
- ``fake_nvml``: an in-memory NVML that keeps MIG's rules and pynvml's error codes.
- ``mig_profiles``: pure geometry placement over the MIG profile tables of
  ``flashpoint.policy.mig_table`` (which ``policy`` reads).
- ``mig``: apply a geometry through the adapter after a drain; worker env for a MIG slice.
- ``mps``: MPS control daemons per GPU or MIG instance, and their clients' env.

Nothing is imported here, so ``import flashpoint.gpu.mig_profiles`` stays free of NVML.
"""
