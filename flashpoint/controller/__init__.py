"""The controller process: its actor (``actor.Controller``, I/O only) and what it owns.

``state/`` is the pure half (``ControllerState`` and its events and commands), shared with the
simulator; everything else here does I/O for the controller. Importing this package runs
nothing, so ``flashpoint.controller.state`` loads no actor code.
"""
