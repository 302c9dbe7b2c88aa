"""The prefill/decode signatures' TFLite model, written from the Keras weights.

`keras_attn.runtimes.signatures.tflite_bytes`' contract (`prefill`, `decode`,
`decode_step` and, with `checks="flag"`, the clamped ids and `index` and the
`valid` output: that module's docstring), for a decoder-only LM with static
`B` and `P`, without TensorFlow's trace, SavedModel or converter (which hold
several copies of the weights). The inputs, outputs and subgraphs are named
and ordered as the converter's model has them. The layers, weights and rotary
tables are `keras_attn.export.tflite_decoder.DecoderBuilder`'s; what differs
from LiteRT-LM's model:

- a batch: the rows run through the fully connected layers as one
  `(B * T, hidden)` matrix, and attention is a BATCH_MATMUL per row and
  key/value head;
- one stacked cache, `(N, 2, B, S, H_kv, D)` (`S` is `max_length`, or the
  window of a model whose every layer has the same window shorter than
  `max_length`: a ring buffer, slot = position mod `S`, and `index` may
  pass `max_length`; rotary angles are then computed from the position,
  `p / scaling_factor * RotaryEmbedding.inverse_frequencies`, instead of
  read from a table of `max_length` rows);
- `prefill` attends over its own keys (causal, and the window where a
  layer has one) and lays them into the cache: zeros after the prompt, a
  ring's last `S` positions in their slots;
- `decode` reads each layer's filled slots, rounded up to `read_bucket`
  (`keras_attn.ops.cache.bounded_reads`' rule; a ring: every slot once it
  is full), writes its key and value into that slice with
  DYNAMIC_UPDATE_SLICE, attends, and writes every layer's new slot into
  the stacked cache with one DYNAMIC_UPDATE_SLICE;
- `decode_step` is that `decode` over the `L` slots passed (a dynamic
  axis: `SHAPE` gives `L`, `index` is clamped below it) that returns the
  layers' new slots, packed, instead of writing them (not for a ring).

A model or option not covered raises `NotFusableError`
(`check_direct_signatures`); `tflite_bytes(writer="auto")` then uses the
converter with a warning.
"""

import numpy as np

from keras_attn.export import capabilities
from keras_attn.export import tflite_decoder
from keras_attn.export import tflite_writer
from keras_attn.export.capabilities import NotFusableError

QUANTIZATIONS = tflite_decoder.QUANTIZATIONS  # None, "dynamic", "int4"
CHECKS = ("flag", "none")


def check_direct_signatures(model, *, max_length, batch_size, prompt_length, quantization=None,
                            cache_dtype="float32"):
    """`capabilities.checked` for this writer and the options (static positive sizes)."""
    for name, value in (("batch_size", batch_size), ("prompt_length", prompt_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise NotFusableError(f"{name}={value!r} (the direct writer takes static positive sizes)")
    return capabilities.checked(model, "tflite_signatures", max_length, [
        ("quantization", quantization, QUANTIZATIONS), ("cache_dtype", cache_dtype, ("float32",))])


def write_signatures_tflite(model, path, *, max_length, batch_size, prompt_length, checks="flag",
                            quantization=None, cache_dtype="float32", read_bucket=128):
    """Writes `model`'s `prefill`/`decode` signatures (the contract above) to `path`.

    Returns `tflite_writer.write_model`'s sizes. Raises `NotFusableError` where the model
    or an option is not covered (`check_direct_signatures`).
    """
    if checks not in CHECKS:
        raise ValueError(f"Received an invalid value for argument `checks`, expected one of "
                         f"{list(CHECKS)}. Received: checks={checks!r}")
    description = check_direct_signatures(model, max_length=max_length, batch_size=batch_size,
                                          prompt_length=prompt_length, quantization=quantization,
                                          cache_dtype=cache_dtype)

    def build(writer):
        builder = SignatureBuilder(description, writer, max_length, quantization, read_bucket,
                                   batch_size=int(batch_size), flag=checks == "flag")
        graphs = [builder.decode(), builder.prefill(int(prompt_length))]
        if not builder.ring_window:  # a ring is its window's slots already
            graphs.append(builder.decode(step=True))
        return graphs

    return tflite_writer.write_model(path, build, "keras_attn direct TFLite signatures")


class SignatureBuilder(tflite_decoder.DecoderBuilder):
    """`DecoderBuilder` with the signatures' batch, stacked cache and checks."""

    def __init__(self, description, writer, max_length, quantization, read_bucket, *, batch_size, flag):
        super().__init__(description, writer, max_length, quantization, read_bucket)
        self.batch = batch_size
        self.flag = flag
        slots, ring = description.stacked_cache(max_length)
        self.ring_window = slots if ring else None
        self.cache_length = self.ring_window or self.max_length
        _, self.kv, self.hd = self.sizes[0]

    # -- the two signatures ------------------------------------------------
    def prefill(self, length):
        g = tflite_writer.Graph(self.w, "prefill")
        B, P, S = self.batch, length, self.cache_length
        ids_in = g.tensor("prefill_token_ids", (B, P), np.int32)
        ids, conditions = self._check_ids(g, ids_in)
        if self.flag and P > self.max_length:
            conditions.append(g.const(np.array(False)))  # a prompt longer than the export
        positions = np.arange(P, dtype=np.int32)
        # Rotary rows: a table of max_length rows, or (a ring) the positions.
        rows = g.const(positions if self.ring_window else np.minimum(positions, self.max_length - 1))

        def mask(window):  # (P, 1, P), static
            seen = positions[None, :] <= positions[:, None]
            if window is not None:
                seen &= positions[:, None] - positions[None, :] < window
            return g.const(seen[:, None, :])

        # Slot s of the cache holds the last prompt position p with
        # p mod S == s (p == s without a ring), zeros where there is none.
        filled = min(P, S)
        sources = [s + ((P - 1 - s) // S) * S for s in range(filled)]

        def lay(new):  # (B, P, H_kv, D) -> (B, S, H_kv, D)
            if sources != list(range(P)):
                new = g.gather(new, g.const(np.array(sources, np.int32)), axis=1)
            if filled < S:
                pads = np.array([[0, 0], [0, S - filled], [0, 0], [0, 0]], np.int32)
                new = g.op("PAD", [new, g.const(pads)], (B, S, self.kv, self.hd),
                           options=g.options("PadOptions"))
            return new

        caches = []

        def attend(i, k, v):
            caches.extend((lay(k), lay(v)))
            keys = g.transpose(k, (0, 2, 3, 1))  # (B, H_kv, D, P)
            values = g.transpose(v, (0, 2, 1, 3))  # (B, H_kv, P, D)
            return keys, values, mask(self.windows[i])

        x = self._layers(g, ids, P, rows, attend)
        logits = self._logits(g, x, (B, P))
        cache = g.reshape(self._pack(g, caches), (-1, 2, B, S, self.kv, self.hd))
        return self._finish(g, [ids_in], ["token_ids"], logits, cache, conditions)

    def decode(self, step=False):
        """`decode`, or with `step` `decode_step`: the caller keeps the cache
        and passes its first `L` slots (`L` dynamic, `index < L`); the
        output `new_cache` `(N, 2, B, 1, H_kv, D)` is the slot `index`."""
        name = "decode_step" if step else "decode"
        g = tflite_writer.Graph(self.w, name)
        B, S, kv, hd = self.batch, self.cache_length, self.kv, self.hd
        N = len(self.sizes)
        ids_in = g.tensor(f"{name}_token_ids", (B, 1), np.int32)
        cache_in = g.tensor(f"{name}_cache", (N, 2, B, None if step else S, kv, hd), np.float32)
        index_in = g.tensor(f"{name}_index", (), np.int32)
        ids, conditions = self._check_ids(g, ids_in)
        index = g.reshape(index_in, (1,))
        # The slots held: S, or the length of the part passed to `decode_step`.
        held = g.dims(cache_in, 3, 1) if step else g.const(np.array([S], np.int32))
        if self.flag:
            zero = g.const(np.array([0], np.int32))
            if self.ring_window:
                conditions.append(self._all(g, g.binary("GREATER_EQUAL", index, zero)))
                index = self._minmax(g, "MAXIMUM", index, 0)
            else:
                last = g.binary("SUB", held, g.const(np.array([1], np.int32)))
                clamped = g.binary("MINIMUM", self._minmax(g, "MAXIMUM", index, 0), last)
                conditions.append(self._all(g, g.binary("EQUAL", clamped, index)))
                index = clamped
        slot = index
        if self.ring_window:
            slot = g.binary("FLOOR_MOD", index, g.const(np.array(S, np.int32)))
            rows = index  # angles from the position itself (`_rotary`)
        else:
            rows = self._minmax(g, "MINIMUM", self._minmax(g, "MAXIMUM", index, 0), S - 1)
        # Slots read: the filled ones rounded up to the bucket (at least one), at most those held;
        # a dynamic count unless every one of S slots is read.
        bounded = self.read_bucket is not None and (step or self.read_bucket < S)
        read = self._read_length(g, index, held) if bounded else held
        key_slots, read_len = self._key_slots(g, S, read if step or bounded else None)

        # The cache as (2 N B, S, H_kv, D): layer i's keys are rows [2 i B, 2 i B + B).
        flat = g.reshape(cache_in, (2 * N * B, -1 if step else S, kv, hd))
        size = g.concat([g.const(np.array([B], np.int32)), read, g.const(np.array([kv, hd], np.int32))], 0)
        start = g.concat([g.const(np.array([0], np.int32)), slot, g.const(np.array([0, 0], np.int32))], 0)

        caches = []

        def attend(i, k, v):
            caches.extend((k, v))
            out = []
            for j, new in enumerate((k, v)):
                begin = g.const(np.array([(2 * i + j) * B, 0, 0, 0], np.int32))
                part = g.slice(flat, begin, size, (B, read_len, kv, hd))
                out.append(g.op("DYNAMIC_UPDATE_SLICE", [part, new, start], (B, read_len, kv, hd),
                                options=g.options("DynamicUpdateSliceOptions")))
            keys = g.transpose(out[0], (0, 2, 3, 1))  # (B, H_kv, D, L)
            values = g.transpose(out[1], (0, 2, 1, 3))  # (B, H_kv, L, D)
            # A ring holds only the window's slots: every one is seen.
            return keys, values, self._band(g, key_slots, index, None if self.ring_window else self.windows[i])

        x = self._layers(g, ids, 1, rows, attend)
        logits = self._logits(g, x, (B, 1))
        slots = self._pack(g, caches)  # (2 N, B, 1, H_kv, D)
        if step:
            return self._finish(g, [ids_in, cache_in, index_in], ["token_ids", "cache", "index"],
                                logits, g.reshape(slots, (N, 2, B, 1, kv, hd)), conditions,
                                cache_name="new_cache")
        cache = g.op("DYNAMIC_UPDATE_SLICE", [flat, g.reshape(slots, (2 * N * B, 1, kv, hd)), start],
                     (2 * N * B, S, kv, hd), options=g.options("DynamicUpdateSliceOptions"))
        cache = g.reshape(cache, (N, 2, B, S, kv, hd))
        return self._finish(g, [ids_in, cache_in, index_in], ["token_ids", "cache", "index"],
                            logits, cache, conditions)

    # -- shared by both ------------------------------------------------------
    def _rotary(self, g, described, rows):
        if not self.ring_window:
            return super()._rotary(g, described, rows)
        # A ring's positions pass max_length: the angles from the position.
        return tflite_decoder.rotary_angles(g, described, rows)

    def _pack(self, g, parts):
        """`[keys, values, ...]` `(B, L, H_kv, D)` each, per layer -> `(2 N, B, L, H_kv, D)`."""
        return g.op("PACK", parts, (len(parts), *g.shape(parts[0])),
                    options=g.options("PackOptions", valuesCount=len(parts), axis=0))

    def _minmax(self, g, name, x, bound):
        return g.binary(name, x, g.const(np.array(bound, np.int32)))

    def _all(self, g, condition):
        """A bool scalar: every element of `condition`."""
        axes = g.const(np.arange(len(g.shape(condition)), dtype=np.int32))
        return g.op("REDUCE_ALL", [condition, axes], (), np.bool_,
                    g.options("ReducerOptions", keepDims=False))

    def _check_ids(self, g, ids):
        """Token ids clamped into the vocabulary (with `flag`), and the
        conditions `valid` ANDs."""
        if not self.flag:
            return ids, []
        clamped = self._minmax(g, "MINIMUM", self._minmax(g, "MAXIMUM", ids, 0),
                               self.d.vocabulary_size - 1)
        ok = g.binary("EQUAL", clamped, ids)
        return clamped, [self._all(g, ok)]

    def _finish(self, g, inputs, input_names, logits, cache, conditions, cache_name="cache"):
        """The subgraph and its signature, named and ordered as the converter's."""
        outputs = {cache_name: cache, "logits": logits}
        if self.flag:
            valid = conditions[0]
            for condition in conditions[1:]:
                valid = g.binary("LOGICAL_AND", valid, condition)
            outputs["valid"] = valid
        # The converter lists a dict's outputs in reverse key order.
        return g.finish(list(zip(input_names, inputs)), [(k, outputs[k]) for k in sorted(outputs, reverse=True)],
                        sort=True)
