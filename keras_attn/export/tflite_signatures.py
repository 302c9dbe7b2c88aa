"""The prefill/decode signatures' TFLite model, written from the Keras weights.

`keras_attn.runtimes.signatures.tflite_bytes`' contract (its module docstring
has it in full), for a decoder-only LM, without TensorFlow's trace,
SavedModel or converter (which hold several copies of the weights):

    prefill(token_ids int32 (B, P)) -> logits (B, P, V), cache (N, 2, B, S, H_kv, D)
    decode(token_ids int32 (B, 1), cache, index int32 ()) -> logits (B, 1, V), cache
    decode_step(token_ids, cache[:, :, :, :L], index) -> logits, new_cache (N, 2, B, 1, H_kv, D)

with static `B` and `P`, and, with `checks="flag"`, token ids and `index`
clamped into range and a bool output `valid` (False when anything was
clamped). The inputs, outputs and subgraphs are named and ordered as the
converter's model has them. The decoder's layers and the rotary tables
are `keras_attn.export.tflite_decoder.DecoderBuilder`'s; the weights
(float32, int8 per output channel or int4 blocks, quantized as they are
written), the layers every TFLite writer shares and the streaming of the
constants after the flatbuffer are `keras_attn.export.tflite_writer`'s;
what differs from LiteRT-LM's model:

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
from keras_attn.export.onnx_fused import NotFusableError

QUANTIZATIONS = tflite_decoder.QUANTIZATIONS  # None, "dynamic", "int4"
CHECKS = ("flag", "none")


def check_direct_signatures(model, *, max_length, batch_size, prompt_length, quantization=None,
                            cache_dtype="float32"):
    """`model`'s description when the direct writer covers it and the
    options; else `NotFusableError` naming the first thing it does not
    cover (`keras_attn.export.capabilities`)."""
    if quantization not in QUANTIZATIONS:
        raise NotFusableError(
            f"quantization={quantization!r} (the direct signatures writer writes {list(QUANTIZATIONS)})")
    if cache_dtype != "float32":
        raise NotFusableError(f"cache_dtype={cache_dtype!r} (the direct writer keeps float32 caches)")
    for name, value in (("batch_size", batch_size), ("prompt_length", prompt_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise NotFusableError(f"{name}={value!r} (the direct writer takes static positive sizes)")
    if hasattr(model, "encode"):
        raise NotFusableError("an encoder-decoder model")
    description = capabilities.describe(model, "tflite_signatures")
    capabilities.check(description, "tflite_signatures", max_length)
    return description


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


def signatures_tflite_bytes(model, **kwargs):
    """`write_signatures_tflite` into memory: the flatbuffer's bytes."""
    return tflite_decoder.written_bytes(write_signatures_tflite, model, **kwargs)


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

        def attend(i, k, v):
            new = {"keys": lay(k), "values": lay(v)}
            keys = g.transpose(k, (0, 2, 3, 1))  # (B, H_kv, D, P)
            values = g.transpose(v, (0, 2, 1, 3))  # (B, H_kv, P, D)
            return new, keys, values, mask(self.windows[i])

        x, caches = self._layers(g, ids, P, rows, attend)
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
        if step:
            shape = g.op("SHAPE", [cache_in], (6,), np.int32, g.options("ShapeOptions", outType=2))
            held = g.op("SLICE", [shape, g.const(np.array([3], np.int32)), g.const(np.array([1], np.int32))],
                        (1,), np.int32, g.options("SliceOptions"))
        else:
            held = g.const(np.array([S], np.int32))
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
        if bounded:
            bucket = np.array(self.read_bucket, np.int32)
            blocks = g.binary("FLOOR_DIV", index, g.const(bucket))
            blocks = self._minmax(g, "MAXIMUM", g.add(blocks, g.const(np.array(1, np.int32))), 1)
            read = g.binary("MINIMUM", g.mul(blocks, g.const(bucket)), held)
        else:
            read = held
        key_slots, read_len = self._key_slots(g, S, read if step or bounded else None)
        masks = {}

        def mask(window):  # (1, 1, L): slot j seen when j <= index (and index - j < window)
            if window not in masks:
                m = g.binary("LESS_EQUAL", key_slots, index)
                if window is not None and not self.ring_window:
                    low = g.binary("SUB", index, g.const(np.array(window, np.int32)))
                    m = g.binary("LOGICAL_AND", m, g.binary("GREATER", key_slots, low))
                masks[window] = g.reshape(m, (1, 1, -1))
            return masks[window]

        # The cache as (2 N B, S, H_kv, D): layer i's keys are rows [2 i B, 2 i B + B).
        flat = g.reshape(cache_in, (2 * N * B, -1 if step else S, kv, hd))
        size = g.concat([g.const(np.array([B], np.int32)), read, g.const(np.array([kv, hd], np.int32))], 0)
        start = g.concat([g.const(np.array([0], np.int32)), slot, g.const(np.array([0, 0], np.int32))], 0)

        def attend(i, k, v):
            out = []
            for j, new in enumerate((k, v)):
                begin = g.const(np.array([(2 * i + j) * B, 0, 0, 0], np.int32))
                part = g.op("SLICE", [flat, begin, size], (B, read_len, kv, hd),
                            options=g.options("SliceOptions"))
                out.append(g.op("DYNAMIC_UPDATE_SLICE", [part, new, start], (B, read_len, kv, hd),
                                options=g.options("DynamicUpdateSliceOptions")))
            keys = g.transpose(out[0], (0, 2, 3, 1))  # (B, H_kv, D, L)
            values = g.transpose(out[1], (0, 2, 1, 3))  # (B, H_kv, L, D)
            return {"keys": k, "values": v}, keys, values, mask(self.windows[i])

        x, caches = self._layers(g, ids, 1, rows, attend)
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
    def _layers(self, g, ids, t_len, rows, attend):
        """The decoder blocks over `ids` `(B, T)` at positions `rows` `(T,)`;
        `attend(i, k, v)` (`(B, T, H_kv, D)` each) returns `(cache entries,
        keys (B, H_kv, D, L), values (B, H_kv, L, D), mask (T, 1, L))`.
        Returns the last hidden states `(B T, hidden)` and the cache entries."""
        B = self.batch
        x = self.embed(g, g.reshape(ids, (B * t_len,)))  # (B T, hidden)
        neg = g.const(np.array(np.finfo(np.float32).min, np.float32))
        caches = []
        for i, layer in enumerate(self.d.layers):
            attention = layer.attention
            heads, kv, hd = self.sizes[i]
            groups = heads // kv
            h = self.rms(g, x, layer.attention_norm.epsilon)
            q, k, v = self._qkv(g, h, layer, i)
            q = g.reshape(q, (B, t_len, heads, hd))
            k = g.reshape(k, (B, t_len, kv, hd))
            v = g.reshape(v, (B, t_len, kv, hd))
            q, k = self._positions(g, q, k, attention, rows)
            entry, keys, values, seen = attend(i, k, v)
            caches.append(entry)
            # query: (B, T, H_kv, G D) -> (B, H_kv, T G, D), rows (t, g).
            query = g.reshape(q, (B, t_len, kv, groups * hd))
            if t_len > 1:
                query = g.transpose(query, (0, 2, 1, 3))
            query = g.reshape(query, (B, kv, t_len * groups, hd))
            length = g.shape(keys)[-1]
            scores = g.op("BATCH_MATMUL", [query, keys], (B, kv, t_len * groups, length),
                          options=g.options("BatchMatMulOptions"))
            scores = g.reshape(scores, (B * kv, t_len, groups, -1))  # the mask broadcasts
            probs = self._softmax(g, scores, attention, seen, neg)
            probs = g.reshape(probs, (B, kv, t_len * groups, -1))
            attended = g.op("BATCH_MATMUL", [probs, values], (B, kv, t_len * groups, hd),
                            options=g.options("BatchMatMulOptions"))
            if t_len > 1:
                attended = g.transpose(g.reshape(attended, (B, kv, t_len, groups * hd)), (0, 2, 1, 3))
            x = self._residuals(g, x, g.reshape(attended, (B * t_len, heads * hd)), layer, i)
        return x, caches

    def _logits(self, g, x, leading):
        """The final norm and head over `x` `(B T, hidden)`: logits `(B, T, V)`."""
        table = self.d.embedding
        logits = self.final_logits(g, x, lambda g, h: self.fully_connected(
            g, h, "lm_head", lambda: table.read().T, None, "lm_head"))
        return g.reshape(logits, (*leading, self.d.vocabulary_size))

    def _rotary(self, g, described, rows):
        if not self.ring_window:
            return super()._rotary(g, described, rows)
        # A ring's positions pass max_length: the angles from the position.
        return tflite_decoder.rotary_angles(g, described, rows)

    def _pack(self, g, caches):
        """`[{keys, values}, ...]` `(B, L, H_kv, D)` each -> `(2 N, B, L, H_kv, D)`."""
        parts = [entry[kind] for entry in caches for kind in ("keys", "values")]
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
