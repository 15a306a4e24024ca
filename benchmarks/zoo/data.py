"""Data for the zoo: sklearn's packaged data sets and small synthetic tasks, as numpy arrays (no download).

Every function is deterministic and returns ((x_train, y_train), (x_val, y_val)).
"""

from __future__ import annotations

import numpy as np


def _split(x, y, share: float = 0.75, seed: int = 0):
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(len(x) * share)
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def _standardise(train, val):
    mean, std = train.mean(0), train.std(0) + 1e-6
    return ((train - mean) / std).astype(np.float32), ((val - mean) / std).astype(np.float32)


def digits(standardise: bool = True):
    """sklearn's 8x8 digits as 64 features: 1347 training and 450 validation samples, 10 classes (int64)."""
    return _classes("load_digits", standardise)


def digit_images(size: int = 8, channels_last: bool = False):
    """The digits as images scaled to [0, 1] and normalised to mean 0, std 1 over the training set:
    [n, 1, size, size] (or [n, size, size, 1] with channels_last), upsampled by repetition when size > 8."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = (x.reshape(-1, 8, 8) / 16.0).astype(np.float32)
    if size != 8:
        factor = -(-size // 8)
        images = images.repeat(factor, axis=1).repeat(factor, axis=2)[:, :size, :size]
    (xt, yt), (xv, yv) = _split(images, y.astype(np.int64))
    mean, std = xt.mean(), xt.std()
    xt, xv = (xt - mean) / std, (xv - mean) / std
    axis = -1 if channels_last else 1
    return (np.expand_dims(xt, axis), yt), (np.expand_dims(xv, axis), yv)


def _classes(loader: str, standardise: bool):
    """One of sklearn's packaged classification sets, split, its features standardised over the training set."""
    import sklearn.datasets

    x, y = getattr(sklearn.datasets, loader)(return_X_y=True)
    (xt, yt), (xv, yv) = _split(x.astype(np.float32), y.astype(np.int64))
    if standardise:
        xt, xv = _standardise(xt, xv)
    return (xt, yt), (xv, yv)


def breast_cancer(standardise: bool = True):
    """sklearn's breast cancer: 30 features, binary labels (int64)."""
    return _classes("load_breast_cancer", standardise)


def wine(standardise: bool = True):
    """sklearn's wine: 13 features, 3 classes (int64)."""
    return _classes("load_wine", standardise)


def diabetes(standardise: bool = True):
    """sklearn's diabetes regression: 10 features, a float32 target standardised over the training set."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    (xt, yt), (xv, yv) = _split(x.astype(np.float32), y.astype(np.float32))
    if standardise:
        xt, xv = _standardise(xt, xv)
        mean, std = yt.mean(), yt.std()
        yt, yv = ((yt - mean) / std).astype(np.float32), ((yv - mean) / std).astype(np.float32)
    return (xt, yt), (xv, yv)


def token_classes(n: int = 2000, length: int = 16, vocab: int = 64, classes: int = 4, seed: int = 0):
    """Token sequences (int64 [n, length], 0 is padding) whose class is the one marker token (1..classes) hidden at a
    random position among filler tokens (classes+1 .. vocab-1); each sequence is padded at its end to a random
    length of at least length/2. A model must find the marker: attention or a recurrent state learns it."""
    rng = np.random.default_rng(seed)
    x = rng.integers(classes + 1, vocab, size=(n, length))
    y = rng.integers(0, classes, size=n)
    lengths = rng.integers(length // 2, length + 1, size=n)
    positions = (rng.random(n) * lengths).astype(int)
    x[np.arange(n), positions] = y + 1
    x[np.arange(length)[None, :] >= lengths[:, None]] = 0
    return _split(x.astype(np.int64), y.astype(np.int64))


def token_streams(n: int = 2000, length: int = 16, vocab: int = 32, seed: int = 0):
    """Sequences for a language model (int64 [n, length]): each counts up from a random start by a step of 1, 2 or 3
    (mod vocab), so every next token follows from the two before it. Targets are the inputs shifted by one."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(n, 1))
    step = rng.integers(1, 4, size=(n, 1))
    x = ((start + step * np.arange(length + 1)[None, :]) % vocab).astype(np.int64)
    (xt, _), (xv, _) = _split(x, np.zeros(n))
    return (xt[:, :-1], xt[:, 1:]), (xv[:, :-1], xv[:, 1:])


def ranking(n_queries: int = 200, per_query: int = 10, features: int = 8, seed: int = 0):
    """A learning-to-rank task: (x [n, features] float32, relevance 0-3 int, query ids), train and validation.
    Relevance is a noisy function of the first three features."""
    rng = np.random.default_rng(seed)
    n = n_queries * per_query
    x = rng.normal(size=(n, features)).astype(np.float32)
    score = x[:, 0] + 0.5 * x[:, 1] - 0.5 * x[:, 2] + 0.3 * rng.normal(size=n)
    relevance = np.digitize(score, np.quantile(score, [0.5, 0.75, 0.9])).astype(np.int64)
    qid = np.repeat(np.arange(n_queries), per_query)
    cut = int(n_queries * 0.75) * per_query
    return (x[:cut], relevance[:cut], qid[:cut]), (x[cut:], relevance[cut:], qid[cut:])


def token_presence(n: int = 512, length: int = 16, vocab: int = 64, token: int = 5, seed: int = 0):
    """Token id rows for a sequence classifier (int64 [n, length], starting with id 1, a [CLS]): the label (int64) is
    whether `token` appears in the row, in about half of them, at a random position."""
    rng = np.random.default_rng(seed)
    x = rng.integers(token + 1, vocab, size=(n, length))
    y = (rng.random(n) < 0.5).astype(np.int64)
    x[np.flatnonzero(y), rng.integers(1, length, size=int(y.sum()))] = token
    x[:, 0] = 1
    return _split(x.astype(np.int64), y)


def repeating_sequences(n: int = 512, length: int = 24, period: int = 4, vocab: int = 32, seed: int = 0):
    """Rows for a causal language model (int64 [n, length]): a random pattern of `period` tokens, repeated, so
    every token after the first period follows from the one `period` before it. The targets are the rows (the
    model shifts them)."""
    rng = np.random.default_rng(seed)
    x = np.tile(rng.integers(1, vocab, size=(n, period)), -(-length // period))[:, :length].astype(np.int64)
    return _split(x, x)
