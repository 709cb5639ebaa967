"""Two machines without a shared filesystem, simulated: every node runs in
its own working directory. With accelerate's save_on_each_node, the main
process of every node writes a copy and every node loads its own; without
it, only node 0 has the file, and loading fails on every node, clearly.

Usage: torchrun --nnodes 2 --node_rank 0|1 --nproc_per_node 1 each_node.py
"""
import os
from pathlib import Path

import numpy as np
from accelerate.utils import ProjectConfiguration

from common import AcceleratedNet, Checks, MLP, make_accelerator, make_data, report

accelerator = make_accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
rank = accelerator.process_index
X, y = make_data(200)
checks = Checks()
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=2, verbose=0)
net.fit(X, y)


@checks
def layout():
    return {'cwd': os.path.basename(os.getcwd()), 'rank': rank,
            'local_main': accelerator.is_local_main_process,
            'num_processes': accelerator.num_processes}


@checks
def save_on_each_node():
    Path('ckpt').mkdir(exist_ok=True)
    net.save_params(f_params='ckpt/params.pt', f_history='ckpt/history.json')
    files = sorted(p.name for p in Path('ckpt').iterdir())
    fresh = AcceleratedNet(MLP, accelerator=accelerator).initialize()
    fresh.load_params(f_params='ckpt/params.pt', f_history='ckpt/history.json')
    return {
        'files': files,
        'same_predictions': bool(np.array_equal(fresh.predict_proba(X), net.predict_proba(X))),
        'history_epochs': len(fresh.history),
    }


@checks
def main_process_only():
    accelerator.project_configuration.save_on_each_node = False
    Path('only_main').mkdir(exist_ok=True)
    net.save_params(f_params='only_main/params.pt')
    files = sorted(p.name for p in Path('only_main').iterdir())
    try:
        net.load_params(f_params='only_main/params.pt')
        error = None
    except Exception as exc:  # pylint: disable=broad-except
        error = f'{type(exc).__name__}: {exc}'
    return {'files': files, 'load_error': error}


report({'rank': rank, 'checks': checks.results})
