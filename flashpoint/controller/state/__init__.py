"""The controller's pure state: events in, commands out (STYLE §1), no I/O and no clock reads.

The live controller actor and the simulator (``flashpoint.sim.cluster``) drive these same
classes; the import rule (``tests/core/test_import_rule.py``) keeps them free of asyncio, RPC,
torch and every actor module.
"""
