"""python -m accel_mixin env, as torchrun starts it on every rank."""

from accel_mixin.__main__ import main

main(["env"])
