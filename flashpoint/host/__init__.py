"""The host manager process (``actor.HostManager``): devices, the RAM cache, warm workers."""
