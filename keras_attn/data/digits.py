"""The scikit-learn handwritten digits for the image examples (no download).

`load_digits_split` splits the 1,797 real 8x8 digits of
`sklearn.datasets.load_digits` into disjoint train and test sets (stratified,
seeded). `make_strips` places 3-5 digits side by side on a wider canvas with
random gaps and vertical jitter, for the attend-and-caption example; build the
test strips from the test digits only, so no test strip contains a digit that
was seen in training. `encode_captions` turns digit sequences into decoder
inputs and targets with start and end tokens.

NumPy and scikit-learn only: no TensorFlow here.
"""

import dataclasses

import numpy as np

# Token ids of the caption vocabulary: 0 pads, digit d is d + 1.
PAD, START, END = 0, 11, 12
VOCABULARY_SIZE = 13


@dataclasses.dataclass
class DigitsSplit:
    """Disjoint train/test digits; images are float32 in [0, 1], `(N, 8, 8)`.

    `train_index` / `test_index` are the rows of `load_digits()` in each set.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_index: np.ndarray
    test_index: np.ndarray


def load_digits_split(test_fraction=0.25, seed=0):
    """Splits the scikit-learn digits into disjoint train and test sets.

    Args:
        test_fraction: share of the digits held out, in (0, 1).
        seed: seed of the stratified shuffle.

    Returns:
        A `DigitsSplit`.
    """
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(
            "Received an invalid value for argument `test_fraction`, expected a "
            f"float in (0, 1). Received: test_fraction={test_fraction!r}"
        )
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:  # an optional extra
        raise ImportError(
            "The digits examples need scikit-learn: pip install 'keras-attn[examples]'"
        ) from error
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")
    labels = digits.target.astype("int32")
    train_index, test_index = train_test_split(
        np.arange(len(labels)),
        test_size=test_fraction,
        random_state=seed,
        stratify=labels,
    )
    train_index, test_index = np.sort(train_index), np.sort(test_index)
    return DigitsSplit(
        x_train=images[train_index],
        y_train=labels[train_index],
        x_test=images[test_index],
        y_test=labels[test_index],
        train_index=train_index,
        test_index=test_index,
    )


@dataclasses.dataclass
class Strips:
    """Digit strips and where each digit is.

    Attributes:
        images: `(N, height, width)` float32 canvases in [0, 1].
        lengths: `(N,)` number of digits in each strip.
        labels: `(N, max_digits)` digit labels, -1 after the last digit.
        sources: `(N, max_digits)` row of each digit in the `images` given to
            `make_strips`, -1 after the last digit.
        centers_x: `(N, max_digits)` x-centre (pixels) of each digit, NaN
            after the last.
    """

    images: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    sources: np.ndarray
    centers_x: np.ndarray

    def sequences(self):
        return [list(row[:n]) for row, n in zip(self.labels, self.lengths)]


def strip_width(max_digits=5, max_gap=3, max_offset=4, digit_size=8):
    """The canvas width that fits the widest strip."""
    return max_offset + max_digits * digit_size + (max_digits - 1) * max_gap


def make_strips(
    images,
    labels,
    num_strips,
    *,
    min_digits=3,
    max_digits=5,
    max_gap=3,
    max_jitter=2,
    max_offset=4,
    width=None,
    seed=0,
):
    """Places `min_digits`..`max_digits` digits side by side on a canvas.

    Each strip picks its digits at random from `images` (with replacement),
    starts at a random x-offset in `[0, max_offset]`, leaves a random gap of
    `0..max_gap` pixels between neighbours and shifts each digit down by
    `0..max_jitter` pixels. Overlaps are resolved with `max`.

    Args:
        images: `(M, 8, 8)` digits in [0, 1].
        labels: `(M,)` their labels.
        num_strips: how many strips.
        min_digits, max_digits: digits per strip.
        max_gap, max_jitter, max_offset: randomness of the layout (pixels).
        width: canvas width; defaults to `strip_width(...)`.
        seed: seed of the layout and of the choice of digits.

    Returns:
        `Strips`; the canvas height is `8 + max_jitter`.
    """
    images = np.asarray(images, dtype="float32")
    labels = np.asarray(labels)
    if images.ndim != 3 or len(images) != len(labels) or len(images) == 0:
        raise ValueError(
            "Expected non-empty `images` of shape (M, h, w) and `labels` of "
            f"shape (M,). Received: images.shape={images.shape}, "
            f"labels.shape={labels.shape}"
        )
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            "Expected 1 <= min_digits <= max_digits. Received: "
            f"min_digits={min_digits}, max_digits={max_digits}"
        )
    size = images.shape[1]
    width = width or strip_width(max_digits, max_gap, max_offset, images.shape[2])
    needed = strip_width(max_digits, max_gap, max_offset, images.shape[2])
    if width < needed:
        raise ValueError(
            f"Received an invalid value for argument `width`, expected at least "
            f"{needed} for these layout settings. Received: width={width}"
        )
    rng = np.random.default_rng(seed)
    height = size + max_jitter
    canvases = np.zeros((num_strips, height, width), "float32")
    lengths = rng.integers(min_digits, max_digits + 1, size=num_strips)
    out_labels = np.full((num_strips, max_digits), -1, "int32")
    sources = np.full((num_strips, max_digits), -1, "int64")
    centers = np.full((num_strips, max_digits), np.nan, "float32")
    for i, n in enumerate(lengths):
        x = int(rng.integers(0, max_offset + 1))
        for j in range(n):
            k = int(rng.integers(len(images)))
            y = int(rng.integers(0, max_jitter + 1))
            w = images.shape[2]
            patch = canvases[i, y : y + size, x : x + w]
            np.maximum(patch, images[k], out=patch)
            out_labels[i, j] = labels[k]
            sources[i, j] = k
            centers[i, j] = x + (w - 1) / 2.0
            x += w + int(rng.integers(0, max_gap + 1))
    return Strips(canvases, lengths.astype("int32"), out_labels, sources, centers)


def encode_captions(strips, max_digits=5):
    """Teacher-forcing arrays for the digit sequences of `strips`.

    Returns:
        `(decoder_inputs, targets, weights)`, each `(N, max_digits + 1)`:
        inputs are `[START, d1+1, ..., dn+1, PAD...]`, targets
        `[d1+1, ..., dn+1, END, PAD...]`, weights 1 where the target is real.
    """
    n = len(strips.lengths)
    length = max_digits + 1
    inputs = np.full((n, length), PAD, "int32")
    targets = np.full((n, length), PAD, "int32")
    inputs[:, 0] = START
    for i, (row, k) in enumerate(zip(strips.labels, strips.lengths)):
        tokens = row[:k] + 1
        inputs[i, 1 : k + 1] = tokens
        targets[i, :k] = tokens
        targets[i, k] = END
    weights = (targets != PAD).astype("float32")
    return inputs, targets, weights


def decode_tokens(tokens):
    """Digits of a token sequence, up to (not including) the first END/PAD."""
    digits = []
    for t in tokens:
        t = int(t)
        if t in (END, PAD) or t == START:
            break
        digits.append(t - 1)
    return digits
