"""A Hugging Face transformer in a scikit-learn pipeline, trained with accelerate.

    python examples/transformer.py
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/transformer.py

The workload skorch.hf exists for, with nothing downloaded: a WordPiece
tokenizer (skorch's ``HuggingfaceTokenizer``) trained on the example's own
generated text, once, by the main process, and loaded by every rank into
the pipeline (``HuggingfacePretrainedTokenizer``), and a small BERT built
from its config, randomly initialised. bf16 autocast, gradient accumulation
2, a grid search over two learning rates, then the best net's parameters
saved and loaded into a plain skorch net, which predicts the same under the
same autocast. Needs the examples extra (``pip install '.[examples]'`` in a
checkout: transformers, tokenizers).

Each rank pads its batches to their own longest sequence, so the ranks see
batches of different lengths. Only the main process prints.
"""

import argparse
import hashlib
import json
import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline
from skorch import NeuralNetClassifier
from skorch.hf import HuggingfacePretrainedTokenizer, HuggingfaceTokenizer
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import Lowercase
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.trainers import WordPieceTrainer
from transformers import BertConfig, BertForSequenceClassification

from accel_mixin import AccelerateMixin

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked DataLoader workers, grid search
VOCAB, MAX_LENGTH = 300, 40
TOPICS = (
    "apple banana cherry grape lemon mango melon peach pear plum berry fig kiwi lime",
    "engine wheel brake gear piston clutch axle motor tire valve pedal chassis rotor bolt",
)
FILLER = "the a of and with very some this that my your our their one two old new big small"


def make_text(n, seed):
    """Sentences of 4 to 30 words, mostly of one topic's words: the label."""
    rng = np.random.default_rng(seed)
    topics, filler = [t.split() for t in TOPICS], FILLER.split()
    texts, labels = [], rng.integers(0, 2, n)
    for label in labels:
        length = int(rng.integers(4, 31))
        # a word of its topic (45%), of the other topic (5%), or filler
        pools = [topics[label], topics[1 - label], filler]
        draw = rng.choice(3, size=length, p=[0.45, 0.05, 0.5])
        words = [rng.choice(pools[d]) for d in draw]
        texts.append(" ".join(words))
    return np.array(texts), labels.astype(np.int64)


class Classifier(torch.nn.Module):
    """A 2-layer BERT, hidden size 64, from its config; it returns the model's
    ``ModelOutput``, whose logits the net reads."""

    def __init__(self, hidden_size=64, layers=2):
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=2,
            intermediate_size=2 * hidden_size,
            max_position_embeddings=MAX_LENGTH,
            num_labels=2,
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask):
        # the batch's longest sequence, not the tokenizer's max_length
        length = int(attention_mask.sum(dim=1).max())
        return self.bert(input_ids=input_ids[:, :length], attention_mask=attention_mask[:, :length])


class LogitsMixin:
    """The model returns a ``ModelOutput``: the loss and the probabilities
    come from its logits."""

    def infer(self, x, **fit_params):
        return super().infer(x, **fit_params).logits


class PlainNet(LogitsMixin, NeuralNetClassifier):
    pass


class AcceleratedNet(AccelerateMixin, PlainNet):
    pass


NET = {
    "module": Classifier,
    "criterion": torch.nn.CrossEntropyLoss,
    "optimizer": torch.optim.AdamW,
    "max_epochs": 5,
    "batch_size": 16,
    "train_split": None,
    "verbose": 0,
}


def train_tokenizer(texts):
    # a trainer, not trainer__* settings: skorch's get_params leaves those out,
    # so clones would train with the defaults (a progress bar, no [PAD] token)
    trainer = WordPieceTrainer(
        vocab_size=VOCAB, special_tokens=["[UNK]", "[PAD]"], show_progress=False
    )
    return HuggingfaceTokenizer(
        tokenizer=Tokenizer(WordPiece(unk_token="[UNK]")),
        normalizer=Lowercase(),
        pre_tokenizer=Whitespace(),
        trainer=trainer,
        max_length=MAX_LENGTH,
    ).fit(texts)


def shared_tokenizer(accelerator, texts, dirname):
    """A tokenizer trained once, by the main process, and loaded from its file
    by every rank: its training is not deterministic (the vocabulary's order
    differs from process to process), so tokenizers trained on each rank
    would give the ranks other token ids for the same text."""
    path = os.path.join(dirname, "tokenizer")
    if accelerator.is_main_process:
        train_tokenizer(texts).fast_tokenizer_.save_pretrained(path)
    accelerator.wait_for_everyone()
    return HuggingfacePretrainedTokenizer(tokenizer=path, max_length=MAX_LENGTH)


def digest(module):
    values = b"".join(p.detach().cpu().numpy().tobytes() for p in module.state_dict().values())
    return hashlib.sha256(values).hexdigest()[:16]


def main(dirname):
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    say = accelerator.print
    set_seed(0)
    X, y = make_text(320, seed=1)
    X_test, y_test = make_text(200, seed=2)
    tokenizer = shared_tokenizer(accelerator, X, dirname)
    pipe = Pipeline(
        [("tokenizer", tokenizer), ("net", AcceleratedNet(accelerator=accelerator, **NET))]
    )
    search = GridSearchCV(pipe, {"net__lr": [1e-3, 3e-3]}, cv=2, scoring="accuracy", refit=True)
    search.fit(X, y)
    net = search.best_estimator_.named_steps["net"]
    accuracy = search.best_estimator_.score(X_test, y_test)
    best_lr = search.best_params_["net__lr"]
    say(f"grid search: best lr {best_lr}, cv accuracy {search.best_score_:.3f}")
    say(f"test accuracy {accuracy:.3f} (chance 0.5)")

    f_params = os.path.join(dirname, "transformer.pt")
    net.save_params(f_params=f_params)
    plain = PlainNet(**NET).initialize()
    plain.load_params(f_params=f_params)
    tokens = search.best_estimator_.named_steps["tokenizer"].transform(X_test)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the precision the net predicts in
        plain_predictions = plain.forward(tokens).argmax(dim=1).numpy()
    same = bool((plain_predictions == net.predict(tokens)).all())
    say(f"plain skorch net with the saved parameters predicts the same: {same}")
    accelerator.end_training()  # ends the process group before Python exits
    return {
        "accuracy": float(accuracy),
        "best_lr": best_lr,
        "same_predictions": same,
        "digest": digest(net.module_),
        "processes": accelerator.num_processes,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        default="transformer-example",
        help="where to save the parameters, seen by every rank",
    )
    parser.add_argument("--report", help="a folder for each rank's outcome, as JSON (the tests')")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    outcome = main(args.dir)
    if args.report:
        rank = int(os.environ.get("RANK", 0))
        with open(os.path.join(args.report, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(outcome, f)
