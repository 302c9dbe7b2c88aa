"""LiteRT-LM's TFLite model of a decoder-only LM, written from the Keras weights.

The flatbuffer `keras_attn.runtimes.litertlm` bundles (signatures
`prefill_<T>` and `decode`, inputs `tokens` int32 `(1, T)` and `input_pos`
int32 `(T,)`, per-layer caches `kv_cache_k_<i>` / `kv_cache_v_<i>` float32
`(1, max_length, H_kv, head_dim)` in and out under one name, `decode`'s
`logits` `(1, 1, V)`), written op by op with the builtin ops TensorFlow's
converter emits for the traced model (FULLY_CONNECTED, BATCH_MATMUL,
SOFTMAX, GATHER, DYNAMIC_UPDATE_SLICE, RSQRT/MEAN/MUL for RMSNorm...), so
that LiteRT and XNNPACK run it as they run the converted one, without
TensorFlow's graph, SavedModel or converter:

- one chunk of `T` tokens at positions `input_pos[0] + [0, T)` (the
  runtime pads a short prompt chunk at its end); rotary angles are the
  layer's own `RotaryEmbedding` evaluated at every cache position
  (`keras_attn.description.rotary_tables`, so static `rope_scaling`,
  and LongRoPE within its original length, are exact) and gathered at
  those positions, over the first `rotary_dim` features of each head;
- `decode` writes its keys and values with DYNAMIC_UPDATE_SLICE (in place
  in LiteRT-LM, which passes one buffer as input and output); a prefill
  chunk with a GATHER of its rows and a SELECT over the slots (a chunk may
  run past the cache's end: those slots are dropped, as
  `keras_attn.ops.write_cache` drops them);
- attention reads the filled slots only, rounded up to `read_bucket`
  (`keras_attn.ops.cache.bounded_reads`' rule), with grouped heads in one
  BATCH_MATMUL per kv head group, key `j` seen by the query at `p` when
  `j <= p` (and `p - j < sliding_window` on windowed layers);
- RMSNorm scales and the `1/sqrt(head_dim)` query scale are folded into the
  following FULLY_CONNECTED weights (exact in real arithmetic; the
  converter folds the norms too), the query scale into the QK-norm's scale
  where the model has one; sandwich norms after each branch, the attention
  and final soft caps (`c * tanh(x / c)`), layers without rotary, the
  embedding scale as the model has them; a prefill signature stops after
  the last layer's cache write (it outputs only the caches).

Weights are quantized as `write_decoder_tflite`'s `quantization` says: int8
in the converter's dynamic-range layout (FULLY_CONNECTED runs LiteRT's
hybrid kernels with `asymmetric_quantize_inputs`), int4 in
ai-edge-quantizer's `dynamic_wi4b32_afp32` layout
(`tflite_writer.quantize_blocks`), which LiteRT's builtin FULLY_CONNECTED
and XNNPACK run with int8 inputs quantized per row. A tied token table is
stored once, as the head's weight, and looked up through it (int8: GATHER,
CAST and a MUL by the gathered per-row scales, where the converter's
lookup table is int8 with one scale; int4: EMBEDDING_LOOKUP's blockwise
kernel). Every constant streams to the file as it is made (`tflite_writer`).

With `lora_rank` (16 or 32), the signatures hold the frozen kernels of a
model's PEFT-style adapters and take every attention projection's LoRA
weights as inputs, named as LiteRT-LM names them; `write_lora_tflite`
writes the file LiteRT-LM binds to them (see `write_decoder_tflite`).

A model or option the writer does not cover raises `NotFusableError` naming
it (`check_direct_decoder`); `keras_attn.runtimes.litertlm` then falls back
to the converter with a warning.
"""

import os
import tempfile

import numpy as np

from keras_attn.description import array_of
from keras_attn.export import capabilities
from keras_attn.export.tflite_writer import INT4
from keras_attn.export.tflite_writer import Graph
from keras_attn.export.tflite_writer import write_model

QUANTIZATIONS = (None, "dynamic", "int4")
# The attention projections LiteRT-LM feeds LoRA weights to (its
# `IsLoRAInputName`: `lora_atten_(q|k|v|o)_(a|b)_prime_weight_<layer>`, the
# names ai-edge-torch's LoRA signatures take), and our description's names.
LORA_PROJECTIONS = (("q", "query"), ("k", "key"), ("v", "value"), ("o", "output"))
# The LoRA ranks LiteRT-LM 0.18's CPU executor runs (others: "Currently only
# support rank 16 and 32", runtime/components/lora.cc).
LORA_RANKS = (16, 32)
# LiteRT-LM maps a LoRA tensor's data in whole pages of this size
# (`MemoryMappedFileWithAutoAlignment`), so a LoRA file's size is a multiple of it.
LORA_FILE_ALIGNMENT = 4096


def lora_inputs(description, rank):
    """`[(input name, shape, layer, letter, Dense)]`: the LoRA weights a
    signature of rank `rank` takes, `a'` `(in, rank)` and `b'` `(rank, out)`
    of every attention projection of every layer, named as LiteRT-LM names them."""
    inputs = []
    for i, layer in enumerate(description.layers):
        for letter, attribute in LORA_PROJECTIONS:
            dense = getattr(layer.attention, attribute)
            if dense is None:  # a layer reading another's keys and values
                continue
            k, n = dense.kernel.shape
            inputs.append((f"lora_atten_{letter}_a_prime_weight_{i}", (k, rank), i, letter, dense))
            inputs.append((f"lora_atten_{letter}_b_prime_weight_{i}", (rank, n), i, letter, dense))
    return inputs


def check_direct_decoder(model, quantization=None, max_length=None, adapters=False):
    """`capabilities.checked` for this writer and `quantization` (its LoRA
    adapters kept apart, with `adapters`)."""
    return capabilities.checked(model, "litertlm", max_length, [("quantization", quantization, QUANTIZATIONS)],
                                adapters)


def write_decoder_tflite(model, path, *, max_length, prefill_lengths, quantization=None,
                         read_bucket=128, lora_rank=None):
    """Writes the LiteRT-LM TFLite model of `model` (a `DecoderOnlyLM`) to `path`.

    Args:
        model: a built `DecoderOnlyLM` (`check_direct_decoder` says what is covered).
        path: the `.tflite` file to write.
        max_length: the caches' length.
        prefill_lengths: one `prefill_<T>` signature per chunk length `T`.
        quantization: None (float32), "dynamic" (int8 weights per output
            channel) or "int4" (int4 weights in blocks of 32 along the input
            dimension; int8 per output channel where it is not a multiple of 32).
        read_bucket: attention reads the filled slots rounded up to a
            multiple of this (None: every slot).
        lora_rank: None, or a rank `r`: every signature holds the base
            model (each LoRA layer's frozen kernel, its adapter left out)
            and takes the LoRA weights of every attention projection as
            inputs (`lora_inputs`: `a'` `(in, r)`, `b'` `(r, out)`), adding
            `(x @ a') @ b'` to the projection: the inputs LiteRT-LM's CPU
            executor binds in `decode` and `prefill_<T>` from a LoRA file
            (`write_lora_tflite`). Separate LoRA signatures (ai-edge-torch's
            `prefill_<T>_lora_r<r>`) would not do: the executor takes every
            signature whose name starts with "prefill" as the prefill of its
            length, the last one listed winning.

    Returns:
        `{"buffers": n, "weight_bytes": bytes after the flatbuffer,
        "flatbuffer_bytes": n}`.

    Raises:
        NotFusableError: the model (or `quantization`) is not covered.
    """
    description = check_direct_decoder(model, quantization, max_length, adapters=lora_rank is not None)
    lengths = sorted(set(int(t) for t in prefill_lengths))
    if lora_rank is not None:
        lora_rank = check_lora_rank(lora_rank, description)

    def build(writer):
        builder = DecoderBuilder(description, writer, max_length, quantization, read_bucket, lora_rank)
        # Subgraph 0 is `decode`; the runtime finds each signature by name.
        return [builder.signature(name, length, with_logits=name == "decode")
                for name, length in [("decode", 1)] + [(f"prefill_{t}", t) for t in lengths]]

    return write_model(path, build, "keras_attn direct TFLite decoder")


def check_lora_rank(rank, description):
    """`rank` as an int when LiteRT-LM takes LoRA weights of that rank and
    every adapter of `description` fits it, else ValueError (also for an
    adapter that is merged or Keras-style: the description serves it only
    merged, so the frozen kernel would carry the fine-tune)."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or int(rank) not in LORA_RANKS:
        raise ValueError(
            f"Received an invalid value for argument `lora_rank`, expected one of {list(LORA_RANKS)} "
            f"(the LoRA ranks LiteRT-LM runs). Received: lora_rank={rank!r}")
    for layer in description.layers:
        for dense in _adapted(layer):
            if dense.lora is None:
                raise ValueError(
                    f"`{layer.name}/{dense.name}` has a merged or Keras-style (style='keras') LoRA "
                    "adapter: a LoRA file needs the PEFT-style adapter unmerged (`enable_lora`, "
                    "not `merge_lora`). Export without `lora_rank` for the merged model.")
            if dense.lora.a.shape[1] > rank:
                raise ValueError(
                    f"Received an invalid value for argument `lora_rank`, expected at least the "
                    f"adapters' rank ({dense.lora.a.shape[1]} on `{layer.name}/{dense.name}`). "
                    f"Received: lora_rank={rank}")
    return int(rank)


def _adapted(layer):
    """The attention projections of `layer` with an adapter (`lora` None when
    it is served merged only); ValueError for a feed-forward one (LiteRT-LM
    feeds LoRA weights to attention only)."""
    feedforward = layer.feedforward
    for dense in (feedforward.gate, feedforward.up, feedforward.down):
        if _has_adapter(dense):
            raise ValueError(
                f"`{layer.name}/{dense.name}` has a LoRA adapter: LiteRT-LM takes LoRA "
                "weights for the attention projections only (query, key, value, "
                "attention_output). Enable LoRA on those, or merge the adapters "
                "(`merge_lora`) and export without `lora_rank`.")
    attention = layer.attention
    return [d for d in (attention.query, attention.key, attention.value, attention.output)
            if _has_adapter(d)]


def _has_adapter(dense):
    # A merged or Keras-style adapter has no `lora` in the description; its
    # layer still says it has one.
    return dense is not None and (dense.lora is not None or getattr(dense.kernel.owner, "lora_enabled", False))


def lora_weights(description, rank):
    """`{input name: float32 array}`: `description`'s adapters as the inputs
    of `lora_inputs(description, rank)`. `a' = scale * A` `(in, rank)`,
    `b' = B` `(rank, out)` (ai-edge-torch's split of the scale), an adapter
    of a smaller rank zero-padded to `rank`; zeros for a projection
    without an adapter."""
    rank = check_lora_rank(rank, description)
    weights = {}
    for input_name, shape, _, _, dense in lora_inputs(description, rank):
        array = np.zeros(shape, np.float32)
        lora = dense.lora
        if lora is not None:
            r = lora.a.shape[1]
            if "_a_prime_" in input_name:
                array[:, :r] = lora.a.read() * np.float32(lora.scale)
            else:
                array[:r] = lora.b.read()
        weights[input_name] = array
    return weights


def write_lora_tflite(model, path, *, lora_rank):
    """Writes `model`'s LoRA adapters as LiteRT-LM's LoRA file (its
    `LoraData`): a TFLite flatbuffer of one subgraph whose tensors, named as
    the LoRA signatures' inputs (`lora_inputs`), hold `lora_weights` after
    the flatbuffer (`Buffer.offset/size`, the only layout `LoraData` reads),
    and a `lora_rank` metadata entry whose buffer field is the rank."""
    weights = lora_weights(model.describe(), lora_rank)

    def build(writer):
        writer.metadata.append(("lora_rank", int(lora_rank)))
        g = Graph(writer, "lora_params")
        for name, array in weights.items():
            g.tensor(name, array.shape, np.float32, writer.buffer(array, inline=False))
        return [g.finish([], [])]

    info = write_model(path, build, "keras_attn LiteRT-LM LoRA weights")
    # `LoraData` maps each tensor's pages: the last one must lie whole in the file.
    with open(path, "ab") as f:
        f.write(b"\0" * (-f.tell() % LORA_FILE_ALIGNMENT))
    return info


def written_bytes(write, model, **kwargs):
    """The bytes `write(model, path, **kwargs)` writes to a temporary `path`."""
    with tempfile.TemporaryDirectory(prefix="keras_attn_tflite_") as tmp:
        path = os.path.join(tmp, "model.tflite")
        write(model, path, **kwargs)
        with open(path, "rb") as f:
            return f.read()


def rms(g, x, epsilon):
    """`x * rsqrt(mean(x^2) + eps)` over the last axis (the scale is the caller's)."""
    square = g.mul(x, x)
    mean = g.op("MEAN", [square, g.const(np.array([-1], np.int32))], g.shape(x)[:-1] + (1,),
                np.float32, g.options("ReducerOptions", keepDims=True))
    mean = g.add(mean, g.const(np.array(epsilon, np.float32)))
    return g.mul(x, g.op("RSQRT", [mean], g.shape(mean)))


def rotate(g, x, cos, sin):
    """keras_attn's `RotaryEmbedding` of `x` `(..., D)` with `cos` and the
    signed `sin` (`[-sin, sin]`, as `rotary_angles` gives them) over the
    first `rotary_dim` features: `x * cos + swap_halves(x) * sin`."""
    shape = g.shape(x)
    rotary_dim = g.shape(cos)[-1]
    passed = None
    if rotary_dim < shape[-1]:  # partial rotary: the last features pass unchanged
        x, passed = g.split(x, [rotary_dim, shape[-1] - rotary_dim])
    x1, x2 = g.op("SPLIT", [g.const(np.array(-1, np.int32)), x], shape[:-1] + (rotary_dim // 2,),
                  options=g.options("SplitOptions", numSplits=2), outputs=2)
    out = g.add(g.mul(x, cos), g.mul(g.concat([x2, x1], -1), sin))
    return out if passed is None else g.concat([out, passed], -1)


def rotary_angles(g, described, positions):
    """`(cos, sin)` `(T, 1, rotary_dim)` of a described `Rotary` at the int32
    `positions` `(T,)`, as `RotaryEmbedding.call` computes them (float32
    angles `position / scaling_factor * frequency`, then cos and sin; `sin`
    signed for `rotate`), once per rotary layer. No attention factor: only
    LongRoPE has one, which the table refuses where angles are computed."""
    rotary, head_dim = described.layer, described.head_dim

    def make():
        half = described.rotary_dim // 2
        inverse = array_of(rotary.inverse_frequencies(head_dim))
        t_len = g.shape(positions)[0]
        position = g.op("CAST", [positions], (t_len,), np.float32,
                        g.options("CastOptions", inDataType=2, outDataType=0))
        position = g.binary("DIV", position, g.const(np.array(rotary.scaling_factor, np.float32)))
        rows = -1 if t_len is None else t_len  # an encoder's length is the call's
        angles = g.mul(g.reshape(position, (rows, 1)), g.const(inverse.reshape(1, half)))
        cos, sin = g.op("COS", [angles], (t_len, half)), g.op("SIN", [angles], (t_len, half))
        minus = g.mul(sin, g.const(np.array(-1.0, np.float32)))
        cos, sin = g.concat([cos, cos], -1), g.concat([minus, sin], -1)
        return g.reshape(cos, (rows, 1, 2 * half)), g.reshape(sin, (rows, 1, 2 * half))

    return g.cached(("rotary", id(rotary), head_dim), make)


class DecoderBuilder:
    """Writes the signatures of a described decoder (`keras_attn.description.Decoder`)."""

    def __init__(self, description, writer, max_length, quantization, read_bucket, lora_rank=None):
        self.d = description
        # With a rank, every signature holds the frozen kernels (`base_kernel`)
        # and takes LoRA inputs (`lora`, set per signature).
        self.lora_rank = lora_rank
        self.lora = {}
        self.w = writer
        self.max_length = int(max_length)
        self.quantization = quantization
        self.read_bucket = read_bucket
        # Each layer's query heads, key/value heads and head size, from its
        # attention (a model may give them per layer).
        self.sizes = [(a.num_heads, a.num_key_value_heads, a.head_dim)
                      for a in (layer.attention for layer in description.layers)]
        self.windows = description.windows()
        self.batch = 1  # the rows of a chunk (`SignatureBuilder`: a batch of them)
        self.rotary_tables = {}  # (id(rotary layer), head_dim) -> (cos, sin) arrays, computed once

    # -- weights -------------------------------------------------------
    def fully_connected(self, g, x, key, make_kernel, bias, name, scale=None):
        """`x (T, K) @ kernel + bias` -> `(T, N)`, the weight of `key` from
        `make_kernel()` and `scale` (a norm's, folded in: `Graph.fc_weight`)."""
        weight = g.fc_weight(key, make_kernel, name + "/weight", self.quantization, scale)
        return g.fully_connected(x, weight, bias, name, f"{g.name}/{name}")

    def embed(self, g, ids):
        # The token table: the tied head's weight (stored once, `(V, hidden)`,
        # quantized as the head) or the embedding's.
        key, name = ("lm_head", "lm_head/weight") if self.d.tied else ("embedding", "embedding/table")
        table = g.fc_weight(key, lambda: self.d.embedding.read().T, name, self.quantization)
        if g.dtype(table) == INT4:
            # The blockwise kernel dequantizes each row it looks up.
            x = g.op("EMBEDDING_LOOKUP", [ids, table], g.shape(ids) + g.shape(table)[1:])
        elif g.dtype(table) == np.int8:
            # int8 rows, then times their scales (a GATHER does not
            # dequantize per row): the head's weight serves as the table.
            buffer, _, shape, scales = self.w.keyed[key]
            x = g.gather_int8(g.tensor(f"{key}/codes", shape, np.int8, buffer), scales, ids, key)
        else:
            x = g.gather(table, ids)
        if self.d.embedding_scale is not None:
            x = g.mul(x, g.const(np.array(self.d.embedding_scale, np.float32)))
        return x

    # -- one signature ----------------------------------------------------
    def signature(self, name, length, with_logits):
        g = Graph(self.w, name)
        d, t_len, S = self.d, length, self.max_length
        tokens = g.tensor(f"{name}_tokens", (1, t_len), np.int32)
        input_pos = g.tensor(f"{name}_input_pos", (t_len,), np.int32)
        caches = [[g.tensor(f"{name}_kv_cache_{kind}_{i}", (1, S, kv, hd), np.float32) for kind in "kv"]
                  for i, (_, kv, hd) in enumerate(self.sizes)]
        inputs = [("tokens", tokens), ("input_pos", input_pos)] + [
            (f"kv_cache_{kind}_{i}", caches[i][j]) for i in range(len(caches)) for j, kind in enumerate("kv")]
        self.lora = {}  # (layer, letter) -> (a', b') input tensors of this signature
        if self.lora_rank is not None:
            for input_name, shape, i, letter, _ in lora_inputs(d, self.lora_rank):
                tensor = g.tensor(f"{name}_{input_name}", shape, np.float32)
                inputs.append((input_name, tensor))
                self.lora.setdefault((i, letter), []).append(tensor)

        # Positions p0 + [0, T); rotary rows clamped into the table (a
        # padded chunk's positions past the end land in dropped slots).
        p0 = g.slice(input_pos, [0], [1], (1,))
        positions = g.add(p0, g.const(np.arange(t_len, dtype=np.int32)))
        rotary_rows = g.binary("MINIMUM", positions, g.const(np.array(S - 1, np.int32)))
        read = None
        if self.read_bucket is not None and self.read_bucket < S:
            last = g.add(p0, g.const(np.array([t_len - 1], np.int32)))
            read = self._read_length(g, last, g.const(np.array(S, np.int32)))
        key_slots, _ = self._key_slots(g, S, read)

        # Cache writes: decode at p0 in place; a chunk through a slot map.
        if t_len == 1:
            start = g.concat([g.const(np.array([0], np.int32)), p0,
                              g.const(np.array([0, 0], np.int32))], 0)
        else:
            relative = g.binary("SUB", g.const(np.arange(S, dtype=np.int32)), p0)
            inside = g.binary("LOGICAL_AND",
                              g.binary("GREATER_EQUAL", relative, g.const(np.array(0, np.int32))),
                              g.binary("LESS", relative, g.const(np.array(t_len, np.int32))))
            inside = g.reshape(inside, (1, S, 1, 1))
            rows = g.binary("MAXIMUM", g.binary("MINIMUM", relative, g.const(np.array(t_len - 1, np.int32))),
                            g.const(np.array(0, np.int32)))

        def write(cache, new):  # new: (1, T, H_kv, D)
            if t_len == 1:
                return g.op("DYNAMIC_UPDATE_SLICE", [cache, new, start], g.shape(cache),
                            options=g.options("DynamicUpdateSliceOptions"))
            spread = g.gather(new, rows, axis=1)
            return g.op("SELECT_V2", [inside, spread, cache], g.shape(cache),
                        options=g.options("SelectV2Options"))

        def read_slots(cache):
            if read is None:
                return cache
            _, _, kv, hd = g.shape(cache)
            size = g.cached(("read_size", kv, hd), lambda: g.concat(
                [g.const(np.array([1], np.int32)), read, g.const(np.array([kv, hd], np.int32))], 0))
            return g.slice(cache, [0, 0, 0, 0], size, (1, None, kv, hd))

        outputs = {}

        def attend(i, k, v):
            k_cache, v_cache = write(caches[i][0], k), write(caches[i][1], v)
            outputs[f"kv_cache_k_{i}"], outputs[f"kv_cache_v_{i}"] = k_cache, v_cache
            if not with_logits and i == d.num_layers - 1:
                return None  # a prefill outputs only the caches
            keys = g.transpose(read_slots(k_cache), (0, 2, 3, 1))  # (1, H_kv, D, L)
            values = g.transpose(read_slots(v_cache), (0, 2, 1, 3))  # (1, H_kv, L, D)
            return keys, values, self._band(g, key_slots, positions, self.windows[i])

        x = self._layers(g, tokens, t_len, rotary_rows, attend)
        if with_logits:
            outputs["logits"] = self._logits(g, x, (1, t_len))
        return g.finish(inputs, list(outputs.items()))

    def _layers(self, g, ids, t_len, rows, attend):
        """The decoder blocks over `ids` `(B, T)` at positions `rows` `(T,)`;
        `attend(i, k, v)` (`(B, T, H_kv, D)` each, `k` rotated) writes layer
        `i`'s cache and returns `(keys (B, H_kv, D, L), values (B, H_kv, L, D),
        mask (T, 1, L))`, or None to stop there. Returns the last hidden
        states `(B T, hidden)`."""
        B = self.batch
        x = self.embed(g, g.reshape(ids, (B * t_len,)))  # (B T, hidden)
        neg = g.const(np.array(np.finfo(np.float32).min, np.float32))
        for i, layer in enumerate(self.d.layers):
            attention = layer.attention
            heads, kv, hd = self.sizes[i]
            groups = heads // kv
            h = rms(g, x, layer.attention_norm.epsilon)
            q, k, v = self._qkv(g, h, layer, i)
            q = g.reshape(q, (B, t_len, heads, hd))
            k = g.reshape(k, (B, t_len, kv, hd))
            v = g.reshape(v, (B, t_len, kv, hd))
            q, k = self._positions(g, q, k, attention, rows)
            attended = attend(i, k, v)
            if attended is None:
                break
            keys, values, seen = attended
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
        return x

    def _band(self, g, key_slots, positions, window):
        """`(T, 1, L)` bool: key slot `j` seen by the query at `p` (`positions`
        `(T,)`) when `j <= p` (and `p - j < window`)."""
        def make():
            keys, query = g.cached("band_axes", lambda: (
                g.reshape(key_slots, (1, 1, -1)), g.reshape(positions, (g.shape(positions)[0], 1, 1))))
            seen = g.binary("LESS_EQUAL", keys, query)
            if window is None:
                return seen
            low = g.binary("SUB", query, g.const(np.array(window, np.int32)))
            return g.binary("LOGICAL_AND", seen, g.binary("GREATER", keys, low))
        return g.cached(("band", window), make)

    def _read_length(self, g, last, held):
        """`(1,)` int32: the slots read by queries up to `last`, the filled ones
        rounded up to `read_bucket` (at least one bucket), at most `held`
        (`keras_attn.ops.cache.bounded_reads`' rule)."""
        bucket, one = g.const(np.array(self.read_bucket, np.int32)), g.const(np.array(1, np.int32))
        blocks = g.binary("MAXIMUM", g.add(g.binary("FLOOR_DIV", last, bucket), one), one)
        return g.binary("MINIMUM", g.mul(blocks, bucket), held)

    def _key_slots(self, g, slots, read):
        """The cache slots attention reads, `(L,)` int32, and `L`: the first
        `read` (a `(1,)` tensor; `L` None), or every one of `slots`."""
        every = g.const(np.arange(slots, dtype=np.int32))
        if read is None:
            return every, slots
        return g.slice(every, [0], read, (None,)), None

    def _qkv(self, g, h, layer, i):
        """The packed query/key/value projection of layer `i` (norm scale and,
        without QK-norm, the query scale folded in), split: `(rows, H D)` each."""
        attention = layer.attention
        heads, kv, hd = self.sizes[i]
        # The 1/sqrt(head_dim) query scale goes into the query weights, or
        # after QK-norm into its scale (`_positions`: the norm would undo it).
        scale = np.float32(1.0 if attention.query_norm is not None else 1.0 / np.sqrt(hd))
        sizes = (heads * hd, kv * hd, kv * hd)

        def kernel():
            packed = np.concatenate([self.base_kernel(dense).read()
                                     for dense in (attention.query, attention.key, attention.value)], axis=1)
            packed[:, :sizes[0]] *= scale
            packed *= layer.attention_norm.scale.read()[:, None]
            return packed

        packed = attention.packed_bias()
        if packed is not None:
            packed[:sizes[0]] *= scale
        qkv = self.fully_connected(g, h, f"layers.{i}/qkv", kernel, packed, f"layers.{i}/attn/qkv")
        q, k, v = g.split(qkv, sizes)
        if not self.lora:
            return q, k, v
        # The adapters read the normed input (the norm's scale is folded
        # into the packed kernel only).
        normed = g.mul(h, g.const(layer.attention_norm.scale.read(), f"layers.{i}/attn_norm/scale"))
        q = g.add(q, g.mul(self._lora_update(g, normed, i, "q"), g.const(np.array(scale, np.float32))))
        return q, g.add(k, self._lora_update(g, normed, i, "k")), g.add(v, self._lora_update(g, normed, i, "v"))

    def base_kernel(self, dense):
        """The kernel a projection's FULLY_CONNECTED holds: the frozen one
        where LoRA weights are inputs, else the kernel with any adapter merged."""
        return dense.lora.base if self.lora_rank is not None and dense.lora is not None else dense.kernel

    def _lora_update(self, g, x, i, letter):
        """`(x @ a') @ b'` with layer `i`'s LoRA inputs of projection `letter`."""
        a, b = self.lora[i, letter]
        low = g.op("BATCH_MATMUL", [x, a], (g.shape(x)[0], g.shape(a)[1]),
                   options=g.options("BatchMatMulOptions"))
        return g.op("BATCH_MATMUL", [low, b], (g.shape(x)[0], g.shape(b)[1]),
                    options=g.options("BatchMatMulOptions"))

    def _positions(self, g, q, k, attention, rows):
        """QK-norm (with the query scale) and the rotation at `rows` over `q`
        and `k` `(..., H, D)`, where the layer has them."""
        if attention.query_norm is not None:
            q = self._rms_norm(g, q, attention.query_norm, np.float32(1.0 / np.sqrt(attention.head_dim)))
            k = self._rms_norm(g, k, attention.key_norm)
        if attention.rotary is not None:
            cos, sin = self._rotary(g, attention.rotary, rows)
            q, k = rotate(g, q, cos, sin), rotate(g, k, cos, sin)
        return q, k

    def _softmax(self, g, scores, attention, seen, neg):
        """Attention probabilities of `scores`: soft-capped where the layer
        is, `neg` where `seen` is False."""
        if attention.logit_soft_cap is not None:
            scores = self._soft_cap(g, scores, attention.logit_soft_cap)
        scores = g.op("SELECT_V2", [seen, scores, neg], g.shape(scores), options=g.options("SelectV2Options"))
        return g.op("SOFTMAX", [scores], g.shape(scores), options=g.options("SoftmaxOptions", beta=1.0))

    def _residuals(self, g, x, attended, layer, i):
        """`x` plus the attention's output projection of `attended`, then plus
        the feed-forward, each branch sandwich-normed where the layer is."""
        out, base = layer.attention.output, f"layers.{i}"
        branch = self.fully_connected(g, attended, f"{base}/o", self.base_kernel(out).read, out.read_bias(),
                                      f"{base}/attn/o")
        if self.lora:
            branch = g.add(branch, self._lora_update(g, attended, i, "o"))
        x = g.add(x, self._rms_norm(g, branch, layer.attention_post_norm))
        branch = self._feedforward(g, x, layer, base)
        return g.add(x, self._rms_norm(g, branch, layer.feedforward_post_norm))

    def _rms_norm(self, g, x, norm, factor=np.float32(1.0)):
        """The RMSNorm `norm` of `x` over its last axis, its scale times
        `factor`; `x` where `norm` is None (a sandwich norm the layer lacks)."""
        if norm is None:
            return x
        return g.mul(rms(g, x, norm.epsilon), g.const(norm.scale.read() * factor))

    def _logits(self, g, x, leading):
        """The final RMSNorm, the head and the final soft cap over `x` `(B T,
        hidden)`: logits `(*leading, V)`. A tied head reads the table as it is
        stored (the final norm's scale multiplies `h` instead of the head's weight)."""
        d = self.d
        gamma = np.array(d.final_norm.scale.read())
        h = rms(g, x, d.final_norm.epsilon)
        if d.tied:
            logits = self.fully_connected(g, g.mul(h, g.const(gamma, "final_norm/scale")), "lm_head",
                                          lambda: d.embedding.read().T, None, "lm_head")
        else:
            logits = self.fully_connected(
                g, h, "lm_head", d.head.kernel.read, d.head.read_bias(), "lm_head", gamma)
        if d.final_logit_soft_cap is not None:
            logits = self._soft_cap(g, logits, d.final_logit_soft_cap)
        return g.reshape(logits, (*leading, d.vocabulary_size))

    def _soft_cap(self, g, x, cap):
        """`cap * tanh(x / cap)`."""
        x = g.mul(x, g.const(np.array(1.0 / cap, np.float32)))
        return g.mul(g.op("TANH", [x], g.shape(x)), g.const(np.array(cap, np.float32)))

    def _rotary(self, g, rotary, rows):
        """`(cos, sin)` `(T, 1, rotary_dim)` at the chunk's positions, read from the model's
        tables (`sin` signed, as `rotate` takes it)."""
        head_dim = rotary.head_dim
        key = (id(rotary.layer), head_dim)
        if key not in self.rotary_tables:
            cos, sin = rotary.tables(self.max_length)
            self.rotary_tables[key] = (np.concatenate([cos, cos], axis=1),
                                       np.concatenate([-sin, sin], axis=1))
        cos_table, sin_table = self.rotary_tables[key]
        return g.cached(("rotary",) + key, lambda: tuple(
            g.reshape(g.gather(g.weight(f"rotary/{key[0]}/{head_dim}/{part}", lambda table=table: (table, None),
                                        f"rotary_{len(self.rotary_tables)}/{part}"), rows),
                      (g.shape(rows)[0], 1, -1))
            for part, table in (("cos", cos_table), ("sin", sin_table))))

    def _feedforward(self, g, x, layer, base):
        norm, feedforward = layer.feedforward_norm, layer.feedforward
        gamma = norm.scale.read()
        h = rms(g, x, norm.epsilon)

        def folded(dense, part):
            return self.fully_connected(g, h, f"{base}/{part}", dense.kernel.read, dense.read_bias(),
                                        f"{base}/mlp/{part}", gamma)

        if feedforward.gate is not None:
            gate, up = folded(feedforward.gate, "gate"), folded(feedforward.up, "up")
            h = g.mul(g.activation(gate, feedforward.activation), up)
        else:
            h = g.activation(folded(feedforward.up, "up"), feedforward.activation)
        down = feedforward.down
        return self.fully_connected(g, h, f"{base}/down", down.kernel.read, down.read_bias(), f"{base}/mlp/down")
