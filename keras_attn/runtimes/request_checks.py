"""Run-time checks of generation requests inside the exported signatures.

SavedModel signatures assert (TF Serving answers INVALID_ARGUMENT naming the
argument); TFLite and ONNX have no assert among their builtin ops, so there
the ids and `index` are clamped into range and a `valid` output says so.
"""

import tensorflow as tf

CHECKS = ("assert", "flag", "none")


class Checks:
    """Run-time checks of one request, in one of the `CHECKS` modes.

    "assert": tf.debugging asserts (InvalidArgumentError naming the argument);
    "flag": clamp into range and AND the conditions into `self.valid`;
    "none": trust the caller.
    """

    def __init__(self, mode, signature):
        self.mode, self.signature = mode, signature
        self.conditions = []

    def _require(self, condition, message, data=(), guarded=None):
        """Asserts or flags `condition`; returns `guarded` ordered after the assert
        (so the model never runs on the bad value before the error is raised)."""
        if self.mode == "assert":
            op = tf.debugging.Assert(condition, [f"{self.signature}: {message}", *data])
            if guarded is not None:
                with tf.control_dependencies([op]):
                    return tf.identity(guarded)
        elif self.mode == "flag":
            self.conditions.append(condition)
        return guarded

    def token_ids(self, name, ids, vocab):
        if vocab is None or self.mode == "none":
            return ids
        low, high = tf.reduce_min(ids), tf.reduce_max(ids)
        ok = tf.logical_or(tf.equal(tf.size(ids), 0),
                           tf.logical_and(low >= 0, high < vocab))
        ids = self._require(ok, f"`{name}` must hold token ids in [0, vocabulary_size="
                            f"{vocab}). Received min, max of `{name}`:", (low, high), ids)
        return tf.clip_by_value(ids, 0, vocab - 1) if self.mode == "flag" else ids

    def index(self, index, cache_length, ring):
        if self.mode == "none":
            return index
        if ring:
            ok = index >= 0
            expected = "`index` must be >= 0 (a ring-buffer cache wraps). Received: index ="
        else:
            ok = tf.logical_and(index >= 0, index < cache_length)
            if isinstance(cache_length, int):
                expected = (f"`index` must be in [0, max_length={cache_length}) (the exported "
                            "cache length). Received: index =")
            else:  # `decode_step`: the slots passed
                expected = ("`index` must be in [0, L), L the slots of the `cache` passed "
                            "(cache.shape[3]). Received: index, L =")
        data = (index,) if ring or isinstance(cache_length, int) else (index, cache_length)
        index = self._require(ok, expected, data, index)
        if self.mode != "flag":
            return index
        return tf.maximum(index, 0) if ring else tf.clip_by_value(index, 0, cache_length - 1)

    def length(self, name, ids, low, high, what):
        """Checks the length of `ids`; returns `ids` (ordered after the assert)."""
        if self.mode == "none":
            return ids
        length = tf.shape(ids)[1]
        return self._require(tf.logical_and(length >= low, length <= high),
                             f"`{name}` must hold {low} to {high} tokens ({what}). "
                             f"Received: {name}.shape[1] =", (length,), ids)

    def valid(self):
        if not self.conditions:
            return tf.constant(True)
        return tf.reduce_all(tf.stack(self.conditions))
