"""Models of text, as a tokenizer feeds them: dict inputs with an attention
mask, each batch cut to its own longest sequence (so the ranks' batches have
other lengths), a ``ModelOutput`` with per-sequence logits and per-token
states. Inference gathers every rank's rows; each is compared with the
module run on that row alone.

Run by sync_checks.py in its launch (``add_checks``), or alone:
torchrun --nproc_per_node 2 sequence_outputs.py
"""

import numpy as np
import torch
from common import AcceleratedNet, Checks, make_accelerator, report
from transformers.modeling_outputs import TokenClassifierOutput

N, LONGEST = 70, 12
rng = np.random.default_rng(0)
lengths = rng.integers(1, LONGEST + 1, N)
mask = (np.arange(LONGEST)[None, :] < lengths[:, None]).astype(np.int64)
X = {"input_ids": rng.integers(1, 50, (N, LONGEST)) * mask, "attention_mask": mask}
y = rng.integers(0, 2, N)


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask):
        length = int(attention_mask.sum(dim=1).max())  # this batch's longest
        states = self.embedding(input_ids[:, :length]) * attention_mask[:, :length, None]
        pooled = states.sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)
        return TokenClassifierOutput(logits=self.head(pooled), hidden_states=states)


class Net(AcceleratedNet):
    def get_loss(self, y_pred, y_true, *args, **kwargs):
        return super().get_loss(y_pred.logits, y_true, *args, **kwargs)


def rows_of_other_lengths_are_gathered():
    net = Net(
        Tagger,
        criterion=torch.nn.CrossEntropyLoss,
        accelerator=make_accelerator(),
        max_epochs=2,
        batch_size=8,
        train_split=None,
        verbose=0,
    )
    net.fit(X, y)
    outputs = list(net.forward_iter(X))
    module = net.accelerator.unwrap_model(net.module_)
    rows = []
    for output in outputs:
        assert type(output) is TokenClassifierOutput, type(output)
        for logits, states in zip(output.logits, output.hidden_states):
            rows.append((logits, states))
    assert len(rows) == N, len(rows)
    widths = set()
    with torch.no_grad():
        for i, (logits, states) in enumerate(rows):
            alone = module(**{k: torch.as_tensor(v[i : i + 1]) for k, v in X.items()})
            n = int(lengths[i])
            assert torch.allclose(logits, alone.logits[0], atol=1e-6), i
            assert torch.allclose(states[:n], alone.hidden_states[0, :n], atol=1e-6), i
            assert not states[n:].any(), i  # padding: zeros at the end
            widths.add(states.shape[0])
    return sorted(widths)


def add_checks(checks):
    """Run this script's check as one of ``checks`` of the launch that imports it."""
    checks(rows_of_other_lengths_are_gathered)


if __name__ == "__main__":
    checks = Checks()
    add_checks(checks)
    report({"checks": checks.results})
