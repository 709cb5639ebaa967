"""Rank helpers in one process; their multi-process side runs in
test_multiprocess.py."""
from types import SimpleNamespace

import pytest
from accelerate import Accelerator

from accel_mixin.distributed import (
    check_process_layout, run_collectively, silent, sink_for)


def fake_accelerator(main=True, processes=1):
    return SimpleNamespace(
        is_main_process=main, num_processes=processes, distributed_type='NO')


def test_layout_refuses_a_group_that_sees_one_process(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv('WORLD_SIZE', '2')
    with pytest.raises(RuntimeError) as exc:
        check_process_layout(accelerator)
    msg = str(exc.value)
    assert 'WORLD_SIZE=2' in msg
    assert 'ACCELERATE_USE_CPU=true' in msg
    assert 'Accelerator(cpu=True)' in msg


@pytest.mark.parametrize('world_size', [None, '1', 'garbage'])
def test_layout_accepts_a_single_process(monkeypatch, world_size):
    accelerator = Accelerator(cpu=True)
    if world_size is None:
        monkeypatch.delenv('WORLD_SIZE', raising=False)
    else:
        monkeypatch.setenv('WORLD_SIZE', world_size)
    check_process_layout(accelerator)


def test_layout_accepts_a_group_the_accelerator_sees(monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '2')
    check_process_layout(fake_accelerator(processes=2))


def test_run_collectively_returns_the_result():
    assert run_collectively(fake_accelerator(), lambda: 42, what='x') == 42


def test_run_collectively_reraises_the_original_error():
    def fail():
        raise FileNotFoundError('missing.pt')

    with pytest.raises(FileNotFoundError, match='missing.pt'):
        run_collectively(fake_accelerator(), fail, what='load_params')


def test_run_collectively_main_only_skips_other_processes():
    calls = []
    assert run_collectively(
        fake_accelerator(main=False), lambda: calls.append(1),
        what='save_params', main_only=True) is None
    assert not calls
    run_collectively(
        fake_accelerator(main=True), lambda: calls.append(1),
        what='save_params', main_only=True)
    assert calls == [1]


def test_sink_is_print_on_the_main_process_only(capsys):
    assert sink_for(fake_accelerator(main=True)) is print
    assert sink_for(fake_accelerator(main=False)) is silent
    silent('nothing')
    assert capsys.readouterr().out == ''
