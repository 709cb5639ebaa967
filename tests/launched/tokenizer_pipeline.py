"""A Hugging Face tokenizer and a net in one Pipeline, fitted on every rank
(``test_examples.py``).

    python tokenizer_pipeline.py per_rank   the Pipeline as skorch users write
                                            it: each rank trains its tokenizer
    python tokenizer_pipeline.py shared     the FAQ's recipe, run as written:
                                            trained once, on the main process,
                                            and given to every rank

Each rank reports a digest of its pipeline's vocabulary (token to id) and
what the fit raised, if anything.
"""

import hashlib
import json
import re
import sys
from pathlib import Path

from common import make_accelerator, report
from sklearn.base import clone
from sklearn.pipeline import Pipeline

from accel_mixin import DistributedError
from examples.transformer import NET, AcceleratedNet, make_text, word_piece_tokenizer

FAQ = Path(__file__).resolve().parents[2] / "docs" / "guide" / "faq.md"
HEADING = "**A `HuggingfaceTokenizer` in a `Pipeline`"


def faq_recipe():
    """The code block of the FAQ's answer on tokenizers in a Pipeline."""
    answer = FAQ.read_text(encoding="utf-8").split(HEADING, 1)[1]
    return re.search(r"```python\n(.*?)```", answer, re.S).group(1)


def main(mode):
    accelerator = make_accelerator()
    X, y = make_text(320, seed=1)
    tokenizer = word_piece_tokenizer()
    tiny = {"module__hidden_size": 16, "module__layers": 1, "max_epochs": 1}
    net = AcceleratedNet(accelerator=accelerator, **dict(NET, **tiny))
    if mode == "per_rank":
        pipe = Pipeline([("tokenizer", tokenizer), ("net", net)])
        code = "pipe.fit(X, y)"
    else:
        pipe, code = None, faq_recipe()
    names = {"accelerator": accelerator, "tokenizer": tokenizer, "net": net, "pipe": pipe}
    names.update(X=X, y=y)
    error = None
    try:
        exec(code, names)  # pylint: disable=exec-used
    except DistributedError as exc:
        error = f"DistributedError: {exc}"
    outcome = {"vocabulary": vocabulary(names["pipe"]), "error": error}
    if mode == "shared":  # a clone, as a search makes, keeps that tokenizer
        outcome["clone_vocabulary"] = vocabulary(clone(names["pipe"]).fit(X, y))
    report(outcome)


def vocabulary(pipe):
    """A digest of the fitted pipeline's vocabulary, token to id."""
    vocab = pipe.named_steps["tokenizer"].fast_tokenizer_.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


if __name__ == "__main__":
    main(sys.argv[1])
