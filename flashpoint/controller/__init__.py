"""The controller process: its actor (``actor.Controller``, I/O only) and what it owns.

``state/`` is the pure half (``ControllerState``, its records, events and commands), shared
with the simulator; ``dispatch.py`` pairs queued requests with replicas (pure too); the rest
does I/O for the controller (``requests.py``: the request path). Importing this package runs
nothing, so ``flashpoint.controller.state`` loads no actor code.
"""
