"""Text-answer rewards: exact match and token F1, on SQuAD-normalised answers (lower case, no punctuation,
no articles, single spaces)."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(response: str, label: str) -> float:
    """1.0 when the normalised response equals the normalised label, else 0.0."""
    return float(normalize_answer(response) == normalize_answer(str(label)))


def f1_score(response: str, label: str) -> float:
    """Harmonic mean of token precision and recall between normalised response and label (bag of words)."""
    pred, gold = normalize_answer(response).split(), normalize_answer(str(label)).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
