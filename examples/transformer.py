"""A Hugging Face transformer in a scikit-learn pipeline, trained with accelerate.

    python examples/transformer.py
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/transformer.py

The workload skorch.hf exists for, with nothing downloaded: a WordPiece
tokenizer (skorch's ``HuggingfaceTokenizer``) trained on the example's own
generated text, once, by the main process, saved in ``--dir`` and loaded by
every rank into the pipeline (``HuggingfacePretrainedTokenizer``), and a
small BERT built from its config, randomly initialised. bf16 autocast,
gradient accumulation 2, a grid search over two learning rates, then the
best net's parameters saved and loaded into a plain skorch net, which
predicts the same under the same autocast. Needs the examples extra
(``pip install '.[examples]'`` in a checkout: transformers, tokenizers).

It resumes: every fit of the search writes training states to
``--dir``/checkpoints (``TrainingCheckpoint``, every 2 batches too), and a
preemption notice (SIGTERM to the launcher) stops every rank at one batch,
saves and exits non-zero. The same command again loads the saved tokenizer
(so the token ids, and with them the runs, are the ones of the first
launch), the fits that had finished resume finished, the one that was
stopped goes on where it stopped, and the search ends as an uninterrupted
one does. Each fit says, on the main process, where it starts.

Each rank pads its batches to their own longest sequence, so the ranks see
batches of different lengths. Only the main process prints.
"""

import argparse
import hashlib
import json
import os
import shutil

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.hf import HuggingfacePretrainedTokenizer, HuggingfaceTokenizer
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import Lowercase
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.trainers import WordPieceTrainer
from transformers import BertConfig, BertForSequenceClassification

from accel_mixin import AccelerateMixin, Preempted
from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

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

    def __init__(self, hidden_size=64, layers=2, seed=0):
        super().__init__()
        # Every fit starts from the same random state: a rerun whose first
        # fits resume finished (and draw nothing) trains the next ones as
        # the uninterrupted search did.
        torch.manual_seed(seed)
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


def word_piece_tokenizer():
    """skorch's ``HuggingfaceTokenizer`` of WordPiece, not trained yet."""
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
    )


def shared_tokenizer(accelerator, texts, dirname):
    """The tokenizer of ``dirname``: trained by the main process in the first
    launch, saved there, and loaded from there by every rank, in that launch
    and every rerun; and whether this launch trained it.

    Its training is not deterministic (its vocabulary differs from one
    training to the next, in one process or several, with one thread or
    many: huggingface/tokenizers#1794): tokenizers trained on each rank can
    give the ranks other token ids for the same text, and one trained again
    by a rerun other ids than the saved training states were trained on, so
    that ``ResumeTraining`` sees other data and starts afresh.
    """
    path = os.path.join(dirname, "tokenizer")
    trained = not os.path.isdir(path)
    accelerator.wait_for_everyone()  # every rank looked before the main process writes
    if accelerator.is_main_process and trained:
        # saved to a folder of its own and renamed into place when complete:
        # a launch stopped while saving leaves no half tokenizer to load
        partial = f"{path}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        word_piece_tokenizer().fit(texts).fast_tokenizer_.save_pretrained(partial)
        os.replace(partial, path)
    accelerator.wait_for_everyone()
    return HuggingfacePretrainedTokenizer(tokenizer=path, max_length=MAX_LENGTH), trained


FITS = []  # what each fit of this launch did (module-level: the search clones its callbacks)


class Progress(Callback):
    """Says on the main process where each fit starts: afresh or from a
    saved training state (which ``ResumeTraining``, listed before it,
    loaded); records that and the epochs of its history when it begins and
    ends."""

    in_run_identity = False  # it only reports: not part of what is trained

    def on_train_begin(self, net, **kwargs):
        state = dict(net.callbacks_)["ResumeTraining"].resumed_from_
        where = state and os.path.join(*state.split(os.sep)[-2:])  # run-<id>/<file>
        FITS.append({"resumed_from": where, "epochs_before": len(net.history)})
        net.accelerator.print(
            f"fit {len(FITS)}: " + (f"resumed from {where}" if where else "started afresh")
        )

    def on_train_end(self, net, **kwargs):
        FITS[-1]["epochs"] = len(net.history)


def digest(module):
    values = b"".join(p.detach().cpu().numpy().tobytes() for p in module.state_dict().values())
    return hashlib.sha256(values).hexdigest()[:16]


def main(dirname):
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    say = accelerator.print
    set_seed(0)
    X, y = make_text(320, seed=1)
    X_test, y_test = make_text(200, seed=2)
    tokenizer, trained = shared_tokenizer(accelerator, X, dirname)
    say(f"tokenizer {'trained and saved to' if trained else 'loaded from'} {dirname}")
    checkpoints = os.path.join(dirname, "checkpoints")
    callbacks = [
        TrainingCheckpoint(checkpoints, every_n_batches=2),
        ResumeTraining(checkpoints),
        Progress(),
    ]
    net = AcceleratedNet(accelerator=accelerator, callbacks=callbacks, **NET)
    pipe = Pipeline([("tokenizer", tokenizer), ("net", net)])
    # error_score="raise": by default a search records a fit's exception as
    # a failed fit and goes on with the next, Preempted included
    search = GridSearchCV(
        pipe,
        {"net__lr": [1e-3, 3e-3]},
        cv=2,
        scoring="accuracy",
        refit=True,
        error_score="raise",
    )
    try:
        search.fit(X, y)
    except Preempted as exc:
        say(str(exc))
        raise
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
        "cv_scores": [float(s) for s in search.cv_results_["mean_test_score"]],
        "tokenizer_trained": trained,
        "fits": FITS,
        "same_predictions": same,
        "digest": digest(net.module_),
        "processes": accelerator.num_processes,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        default="transformer-example",
        help="where the tokenizer, the checkpoints and the parameters go, seen by every rank",
    )
    parser.add_argument("--report", help="a folder for each rank's outcome, as JSON (the tests')")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    outcome = main(args.dir)
    if args.report:
        rank = int(os.environ.get("RANK", 0))
        with open(os.path.join(args.report, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(outcome, f)
