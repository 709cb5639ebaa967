"""One training script, run the ways exact resume is tested.

Usage: resume_run.py MODE DIRNAME [ASYNC]
  full    trains 6 epochs in one go
  crash   trains with TrainingCheckpoint and dies when epoch 4 begins
  resume  the same script again, with ResumeTraining: trains epochs 4 to 6

Shuffled data, dropout, gradient accumulation, a StepLR stepped per batch, a
ReduceLROnPlateau and EarlyStopping's counters all have to continue exactly.
"""
import os
import sys

import torch
from skorch.callbacks import Callback, EarlyStopping, LRScheduler

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from common import AcceleratedNet, make_accelerator, make_data, report

MODE, DIRNAME = sys.argv[1], sys.argv[2]
ASYNCHRONOUS = len(sys.argv) > 3 and sys.argv[3] == 'async'


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
            torch.nn.Linear(32, 2), torch.nn.Softmax(dim=-1))

    def forward(self, X):
        return self.layers(X)


class Preemption(Callback):
    """Dies when epoch 4 begins, as a preempted job would."""

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 4:
            net.wait_for_saves()
            os._exit(3)  # pylint: disable=protected-access


torch.manual_seed(0)
accelerator = make_accelerator(gradient_accumulation_steps=2)
X, y = make_data(500, noise=0.2, seed=3)
callbacks = [
    LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=5, gamma=0.9, step_every='batch'),
    ('plateau', LRScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau, monitor='valid_loss',
                            patience=0, factor=0.7)),
    EarlyStopping(patience=100),
]
if MODE != 'full':
    callbacks.append(TrainingCheckpoint(DIRNAME, keep_last=2, asynchronous=ASYNCHRONOUS))
if MODE == 'crash':
    callbacks.append(Preemption())
if MODE == 'resume':
    callbacks.append(resume := ResumeTraining(DIRNAME))

net = AcceleratedNet(
    DropoutMLP, accelerator=accelerator, max_epochs=6, lr=0.5, batch_size=16,
    iterator_train__shuffle=True, verbose=0, callbacks=callbacks)
net.fit(X, y)

report({
    'history': [{k: v for k, v in row.items() if 'dur' not in k} for row in net.history],
    'resumed_from': os.path.basename(resume.resumed_from_) if MODE == 'resume' else None,
    'files': sorted(os.listdir(DIRNAME)) if MODE != 'full' else [],
    'misses': dict(net.callbacks_)['EarlyStopping'].misses_,
    'params': [p.detach().numpy().tolist() for p in net.module_.parameters()][-1],
})
