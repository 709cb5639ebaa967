"""The net: AccelerateMixin's lifecycle (``mixin``), its save and load
methods (``saving``), its steps (``steps``) and what it keeps for this
process (``local``). The only package that reads the net's private attributes
(tests/test_layout.py).

``AccelerateMixin`` is re-exported here: ``accel_mixin.net.AccelerateMixin``
is a public path, and the one that nets pickled by earlier releases name.
"""

from accel_mixin.net.mixin import AccelerateMixin

__all__ = ["AccelerateMixin"]
