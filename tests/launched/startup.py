"""Nothing but start-up: the imports every launched check makes, the
process group's rendezvous and one barrier, and the report. Its wall time is
what a launch costs before any check runs (``scripts/suite_profile.py``); a
script that fits a net pays about 1.5 s more once, for the first
optimizer's import of ``torch._dynamo``."""

import time

from common import make_accelerator, report

imported = time.monotonic()
accelerator = make_accelerator()
accelerator.wait_for_everyone()
report({"process": accelerator.process_index, "imported": imported})
