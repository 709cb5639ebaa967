"""One voice: only the main process prints and warns."""

import warnings
from types import SimpleNamespace

from accel_mixin.distributed.process_layout import quiet_unless_main, silent, sink_for


def fake_accelerator(main=True):
    return SimpleNamespace(is_main_process=main, num_processes=2, distributed_type="MULTI_CPU")


def test_sink_is_print_on_the_main_process_only(capsys):
    assert sink_for(fake_accelerator(main=True)) is print
    assert sink_for(fake_accelerator(main=False)) is silent
    silent("nothing")
    assert capsys.readouterr().out == ""


def test_quiet_unless_main(capsys):
    with quiet_unless_main(fake_accelerator(main=False)):
        print("rank 1 says")
        warnings.warn("rank 1 warns")
    with quiet_unless_main(fake_accelerator(main=True)):
        print("rank 0 says")
    assert capsys.readouterr().out == "rank 0 says\n"
