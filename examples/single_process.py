"""The smallest accelerated skorch net: one process, bf16 autocast on CPU.

python examples/single_process.py
"""

import numpy as np
import torch
from accelerate import Accelerator
from sklearn.datasets import make_classification
from skorch import NeuralNetClassifier

from accel_mixin import AccelerateMixin


class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    """A NeuralNetClassifier that trains with accelerate."""


X, y = make_classification(1000, 20, n_informative=10, random_state=0)
X = X.astype(np.float32)
module = torch.nn.Sequential(
    torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2), torch.nn.Softmax(dim=-1)
)
net = AcceleratedNet(
    module,
    accelerator=Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2),
    max_epochs=5,
    lr=0.1,
)
net.fit(X, y)
print(f"train accuracy {net.score(X, y):.3f}")
