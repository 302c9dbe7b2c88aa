"""The prefill/decode signatures' ONNX models, written from the Keras weights.

`keras_attn.runtimes.signatures.onnx_models` / `export_onnx` write
`prefill.onnx` and `decode.onnx` (the contract is that module's docstring:
a stacked cache `(num_layers, 2, B, cache_length, H_kv, D)`, `index`, the
`valid` flag of `checks="flag"`) here, op by op in standard ONNX ops (any
ONNX runtime runs them), instead of converting a TensorFlow trace with
tf2onnx, which holds tens of times the weights while it converts. No
TensorFlow graph is involved: it runs on every Keras backend.

- Weights: each written once, streamed to one external data file that both
  models name (`external_data`, each tensor at its own aligned offset), or
  inside each proto. A tied table is stored once and read by the head as a
  `Gemm` with `transB=1` (`onnx_decoder.DecoderGraph.tied_table`).
- Positions: rotary angles gathered from the model's own cos/sin tables
  (`keras_attn.description.rotary_tables`, so static `rope_scaling` is exact); for a
  ring-buffer cache, whose positions run past `max_length`, computed from
  the layer's frequencies (`RotaryEmbedding.inverse_frequencies`) as Keras
  does. Learned and sinusoidal position tables likewise (not with a ring).
- Blocks: RMSNorm in `ReduceMean` / `Sqrt` arithmetic; grouped-query heads
  attend in their groups (no repeated keys).
- Caches: `prefill` attends over its own block (causal, and each layer's
  window) and writes the cache `(N, 2, B, cache_length, H_kv, D)`
  (positions past a plain cache are dropped; a ring buffer keeps the last
  `cache_length`). `decode` reads, per layer, only the slots its query can
  see: `[start, end)` with `end` the filled slots rounded up to
  `read_bucket` and `start` the window's first slot rounded down (a
  `Slice` whose bounds come from `index`), writes its slot there with
  `ScatterND`, and writes every layer's slot into `cache_out` with one
  `ScatterND`. A ring buffer (every layer with one window shorter than
  `max_length`) reads its `window` slots and the new key, as Keras does.
  `decode_step` (not for a ring) is `decode` over the first `L` slots the
  caller passes (`cache_slots`, a dynamic axis; `Shape` gives `L`) that
  returns the layers' new slots, `new_cache (N, 2, B, 1, H_kv, D)`.

What is not covered (`keras_attn.export.capabilities`, "onnx_signatures")
raises `NotFusableError` naming the option; the dispatcher then uses tf2onnx.
"""

import contextlib
import math

import numpy as np

from keras_attn.description import array_of
from keras_attn.export import capabilities
from keras_attn.export.onnx_decoder import DecoderGraph
from keras_attn.ops.masking import MASKED_LOGIT

OPSETS = (17, 18)
# The shared external data file, beside prefill.onnx and decode.onnx.
WEIGHTS_FILE = "signatures.onnx.data"


def check_signature_decoder(model, max_length, opset=17):
    """`capabilities.checked` for this writer, a cache of `max_length` and `opset`."""
    return capabilities.checked(model, "onnx_signatures", max_length, [("opset", opset, OPSETS)])


def signature_models(model, *, max_length, checks="flag", opset=17, read_bucket=128,
                     external_data=None, shared=None):
    """`{"prefill": ModelProto, "decode": ModelProto}` of `model` (see the module docstring).

    Args:
        model: a `DecoderOnlyLM` (`check_signature_decoder`).
        max_length: the cache's positions.
        checks: "flag" (ids and `index` clamped, a bool `valid` output) or "none".
        opset: 17 or 18.
        read_bucket: `decode` reads the filled slots rounded up to a multiple
            of it; None: every slot.
        external_data: None (weights inside each proto; under 2 GB in all) or
            the path of the one file both models' weights are streamed to,
            each once (save the protos in its folder).
        shared: None, or a dict that receives the weights written exactly
            as the model holds them (`onnx_decoder.decoder_model_proto`'s).

    Raises:
        NotFusableError: `model` has an option this writer does not cover.
    """
    if checks not in ("flag", "none"):
        raise ValueError(
            "Received an invalid value for argument `checks`, expected 'flag' or "
            f"'none' (ONNX has no assert op). Received: checks={checks!r}")
    d = check_signature_decoder(model, max_length, opset)
    names = ("prefill", "decode") + (() if d.stacked_cache(max_length)[1] else ("decode_step",))
    with contextlib.ExitStack() as stack:
        data_file = None if external_data is None else stack.enter_context(open(external_data, "wb"))
        # The weights the models share, each written once (`_Signature.weight`).
        weights = DecoderGraph(None, 32, 0, data_file, shared)
        return {name: _Signature(d, name, max_length, checks, opset, read_bucket, weights).proto()
                for name in names}


class _Signature:
    """One of the graphs: `prefill`, `decode` or `decode_step`."""

    def __init__(self, description, kind, max_length, checks, opset, read_bucket, weights):
        self.d, self.kind, self.checks, self.opset = description, kind, checks, opset
        self.max_length, self.bucket, self.weights = max_length, read_bucket, weights
        self.g = DecoderGraph(None, 32, 0)
        self.count = 0
        self.cache_length, self.ring = description.stacked_cache(max_length)
        first = description.layers[0].attention
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_key_value_heads, first.head_dim
        self.conditions = []
        # `decode_step` takes the first L slots of the caller's cache (L dynamic).
        self.step = kind == "decode_step"

    # -- writing ---------------------------------------------------------------

    def name(self, hint):
        self.count += 1
        return f"/{self.kind}/{hint}_{self.count}"

    def op(self, op, inputs, hint, outputs=1, **attrs):
        return self.g.node(op, inputs, self.name(hint), outputs=outputs, **attrs)

    def c(self, value, dtype, hint="c"):
        """A small constant inside the graph."""
        return self.g.const(np.array(value, dtype), self.name(hint))

    def weight(self, key, make):
        """The shared initializer `key` of `make()`, made and written once for every model."""
        return self.weights.once(key, lambda: self.weights.const(make(), key))

    def i64(self, value):
        return self.c(value, np.int64, "i64")

    def f32(self, value):
        return self.c(value, np.float32, "f32")

    # -- the graph ---------------------------------------------------------------

    def proto(self):
        from onnx import TensorProto
        from onnx import helper

        from keras_attn.export.onnx import rename_value

        d = self.d
        vocab = d.vocabulary_size
        ids = self.token_ids("token_ids", vocab)
        if self.kind == "prefill":
            length = self.op("Shape", ["token_ids"], "length", start=1, end=2)  # (1,) int64
            positions = self.op("Range", [self.i64(0), self.op("Squeeze", [length], "P"), self.i64(1)],
                                "positions")
            if self.checks == "flag":
                self.flag(self.op("And", [self.op("GreaterOrEqual", [length, self.i64([1])], "ge"),
                                          self.op("LessOrEqual", [length, self.i64([self.max_length])], "le")],
                                  "length_ok"))
            self.length = length
        else:
            self.index = self.checked_index()
            positions = self.op("Reshape", [self.index, self.i64([1])], "positions")
        self.positions = positions
        x = self.embed(ids, positions)
        new_keys_values = []
        for i, layer in enumerate(d.layers):
            x = self.block(i, layer, x, new_keys_values)
        h = self.norm(x, d.final_norm, "final_norm")
        logits = self.head(h)
        cache = self.cache_out(new_keys_values)

        batch, n = "batch_size", d.num_layers
        slots = "cache_slots" if self.step else self.cache_length
        cache_dims = [n, 2, batch, slots, self.kv_heads, self.head_dim]
        float_, int32 = TensorProto.FLOAT, TensorProto.INT32
        if self.kind == "prefill":
            inputs = [helper.make_tensor_value_info("token_ids", int32, [batch, "prompt_length"])]
            outputs = [("cache", cache, cache_dims), ("logits", logits, [batch, "prompt_length", vocab])]
        else:
            inputs = [helper.make_tensor_value_info("token_ids", int32, [batch, 1]),
                      helper.make_tensor_value_info("cache", float_, cache_dims),
                      helper.make_tensor_value_info("index", int32, [])]
            outputs = [("new_cache", cache, [n, 2, batch, 1, self.kv_heads, self.head_dim]) if self.step
                       else ("cache_out", cache, cache_dims), ("logits", logits, [batch, 1, vocab])]
        infos = [helper.make_tensor_value_info(name, float_, dims) for name, _, dims in outputs]
        if self.checks == "flag":
            valid = self.conditions[0]
            for condition in self.conditions[1:]:
                valid = self.op("And", [valid, condition], "valid")
            outputs.append(("valid", valid, []))
            infos.append(helper.make_tensor_value_info("valid", TensorProto.BOOL, []))
        # The shared weights first, in the order the weights file holds them.
        for i, tensor in enumerate(self.weights.graph.initializer):
            self.g.graph.initializer.insert(i, tensor)
        proto = self.g.finish(f"keras_attn_{self.kind}", inputs, infos, [("", self.opset)],
                              helper.find_min_ir_version_for([helper.make_opsetid("", self.opset)]))
        for name, value, _ in outputs:
            rename_value(proto.graph, value, name)  # the node that makes it writes it: no Identity
        return proto

    def flag(self, condition):
        """ANDs `condition` into the `valid` output (as a scalar)."""
        self.conditions.append(self.op("Reshape", [condition, self.i64(np.zeros(0, np.int64))], "condition"))

    def token_ids(self, name, vocab):
        if self.checks == "none":
            return name
        low = self.op("ReduceMin", [name], "ReduceMin", keepdims=0)
        high = self.op("ReduceMax", [name], "ReduceMax", keepdims=0)
        self.flag(self.op("And", [self.op("GreaterOrEqual", [low, self.c(0, np.int32)], "ge"),
                                  self.op("Less", [high, self.c(vocab, np.int32)], "lt")], "ids_ok"))
        return self.op("Min", [self.op("Max", [name, self.c(0, np.int32)], "clamp"),
                               self.c(vocab - 1, np.int32)], "clamp")

    def checked_index(self):
        """`index` as int64, clamped with `checks="flag"` (a ring buffer: `>= 0`)."""
        index = self.op("Cast", ["index"], "index", to=7)  # INT64
        if self.checks == "none":
            return index
        zero = self.i64(0)
        ok = self.op("GreaterOrEqual", [index, zero], "ge")
        clamped = self.op("Max", [index, zero], "clamp")
        if not self.ring:
            last = self.last_slot()
            ok = self.op("And", [ok, self.op("LessOrEqual", [index, last], "le")], "ok")
            clamped = self.op("Min", [clamped, last], "clamp")
        self.flag(ok)
        return clamped

    def held(self):
        """The slots of the `cache` input, an int64 scalar: `cache_length`, or
        (`decode_step`) the length of the part passed."""
        if not self.step:
            return self.i64(self.cache_length)
        return self.g.once("held", lambda: self.op("Squeeze", [
            self.op("Shape", ["cache"], "held", start=3, end=4)], "held"))

    def last_slot(self):
        """`held() - 1`, the last slot of the `cache` input (a constant for `decode`)."""
        if not self.step:
            return self.i64(self.cache_length - 1)
        return self.g.once("last_slot", lambda: self.op("Sub", [self.held(), self.i64(1)], "last"))

    def embed(self, ids, positions):
        d = self.d
        if d.tied:
            self.tied = self.weights.once("tied", lambda: self.weights.tied_table(d.embedding.read(), "/lm_head"))
            x = self.g.gather_rows(self.tied, ids, self.name("embed_tokens"))
        else:
            table = self.weight("model.embed_tokens.weight", d.embedding.read)
            x = self.op("Gather", [table, ids], "embed_tokens")
        if d.positions.kind != "rotary":
            x = self.op("Add", [x, self.position_rows(positions)], "embed_positions")
        if d.embedding_scale is not None:
            x = self.op("Mul", [x, self.f32(d.embedding_scale)], "embedding_scale")
        return x

    def position_rows(self, positions):
        """The learned or sinusoidal position embeddings `(T, hidden)` at `positions`."""
        described = self.d.positions
        if described.kind == "learned":
            table = self.weight("model.embed_positions.weight", described.table.read)
            rows = described.rows
        else:
            rows, hidden = self.max_length, self.d.hidden_dim
            table = self.weight("model.embed_positions.sinusoids", lambda: array_of(
                described.layer(np.zeros((1, rows, hidden), "float32")))[0])
        return self.op("Gather", [table, self.clipped(positions, rows)], "positions")

    def clipped(self, positions, rows):
        """`positions` clamped into a table of `rows` (an unchecked bad request
        reads a row of it instead of failing)."""
        return self.op("Min", [self.op("Max", [positions, self.i64(0)], "clip"), self.i64(rows - 1)], "clip")

    # -- blocks ---------------------------------------------------------------------

    def block(self, i, layer, x, new_keys_values):
        base = f"layers.{i}"
        h = self.norm(x, layer.attention_norm, base + ".input_norm")
        a = self.attention(i, layer.attention, h, new_keys_values)
        a = self.norm(a, layer.attention_post_norm, base + ".post_attention_norm")
        x = self.op("Add", [x, a], "residual")
        h = self.norm(x, layer.feedforward_norm, base + ".ffn_norm")
        f = self.g.feedforward(h, layer.feedforward, lambda x, part, dense: self.linear(
            x, f"{base}.mlp.{part}", dense, part), lambda op: self.name("gated" if op == "Mul" else op), standard=True)
        f = self.norm(f, layer.feedforward_post_norm, base + ".post_ffn_norm")
        return self.op("Add", [x, f], "residual")

    def norm(self, x, norm, key):
        """A described `Norm` (RMSNorm, or LayerNorm) over the last axis; None
        (a sandwich norm the block lacks): `x`."""
        if norm is None:
            return x
        scale = self.weight(key + ".weight", norm.scale.read)
        if norm.kind == "layer":
            beta = self.weight(key + ".bias", norm.bias.read)
            return self.op("LayerNormalization", [x, scale, beta], "LayerNorm", axis=-1, epsilon=float(norm.epsilon))
        return self.g.rms_norm(x, scale, norm.epsilon, self.opset, self.name)

    def dense(self, x, kernel_key, make_kernel, bias, hint):
        weight = self.weights.once(kernel_key, lambda: self.weights.weight(make_kernel(), kernel_key))
        y = self.g.apply(x, weight, None, self.name(hint))
        if bias is not None and np.any(bias):
            y = self.op("Add", [y, self.weight(kernel_key + ".bias", lambda: bias)], hint + "_bias")
        return y

    def linear(self, x, key, dense, hint):
        """A described `Dense` through `dense` (its kernel read once for every signature)."""
        return self.dense(x, key, dense.kernel.read, dense.read_bias(), hint)

    def attention(self, i, attention, h, new_keys_values):
        base = f"layers.{i}.attn"
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        widths = [heads * d, kv_heads * d, kv_heads * d]
        qkv = self.dense(h, base + ".qkv", attention.packed_kernel, attention.packed_bias(), "qkv")
        q, k, v = self.op("Split", [qkv, self.i64(widths)], "split_qkv", outputs=3, axis=-1)
        q, k, v = (self.op("Reshape", [t, self.i64([0, 0, n, d])], "heads")
                   for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
        if attention.query_norm is not None:
            q = self.g.rms_norm(q, self.weight(base + ".q_norm", attention.query_norm.scale.read),
                                attention.query_norm.epsilon, self.opset, self.name)
            k = self.g.rms_norm(k, self.weight(base + ".k_norm", attention.key_norm.scale.read),
                                attention.key_norm.epsilon, self.opset, self.name)
        rotary = attention.rotary
        if rotary is not None:
            cos, sin = self.rotary(rotary)
            q, k = (self.g.rotate_half(t, cos, sin, d, rotary.rotary_dim, self.name) for t in (q, k))
        window = attention.window
        if self.kind == "prefill":
            keys, values = k, v
            mask = self.g.once(("prefill_mask", window), lambda: self.prefill_mask(window))
        elif self.ring:
            keys, values, mask = self.ring_read(i, k, v, window)
        else:
            k, v = self.kept(i, k, 0), self.kept(i, v, 1)
            keys, values, mask = self.bounded_read(i, k, v, window)
        new_keys_values.append((k, v))
        out = self.attend(q, keys, values, mask, attention.logit_soft_cap)
        return self.linear(out, base + ".o_proj", attention.output, "o_proj")

    # -- positions -------------------------------------------------------------------

    def rotary(self, described):
        """`(cos, sin)` `(1, T, 1, rotary_dim / 2)` at this call's positions."""
        rotary = described.layer

        def make():
            # Named by the first layer using it (a run-independent name: the
            # same model exports to the same bytes).
            first = next(i for i, layer in enumerate(self.d.layers)
                         if layer.attention.rotary is not None and layer.attention.rotary.layer is rotary)
            key = f"rotary.{first}"
            if self.ring:
                freq = self.weight(key + ".inv_freq", lambda: array_of(
                    rotary.inverse_frequencies(self.head_dim)).reshape(1, -1))
                pos = self.op("Cast", [self.positions], "positions_float", to=1)
                if rotary.scaling_factor != 1.0:
                    pos = self.op("Div", [pos, self.f32(rotary.scaling_factor)], "scaled_positions")
                angles = self.op("Mul", [self.op("Unsqueeze", [pos, self.i64([1])], "column"), freq], "angles")
                # No attention factor: only LongRoPE has one, refused with a ring.
                cos, sin = self.op("Cos", [angles], "cos"), self.op("Sin", [angles], "sin")
            else:
                def write():  # `tables` computes cos and sin together
                    cos, sin = described.tables(self.max_length)
                    return self.weights.const(cos, key + ".cos"), self.weights.const(sin, key + ".sin")

                rows = self.clipped(self.positions, self.max_length)
                cos_table, sin_table = self.weights.once(key + ".tables", write)
                cos = self.op("Gather", [cos_table, rows], "cos")
                sin = self.op("Gather", [sin_table, rows], "sin")
            axes = self.i64([0, 2])
            return self.op("Unsqueeze", [cos, axes], "cos"), self.op("Unsqueeze", [sin, axes], "sin")

        return self.g.once(("rotary", id(rotary)), make)

    # -- attention ---------------------------------------------------------------------

    def band(self, query, key, window):
        """Key positions a query sees: `key <= query` and, with a window, `query - key < window`."""
        mask = self.op("LessOrEqual", [key, query], "causal")
        if window is not None:
            near = self.op("Less", [self.op("Sub", [query, key], "distance"), self.i64(window)], "window")
            mask = self.op("And", [mask, near], "band")
        return mask

    def prefill_mask(self, window):
        query = self.op("Unsqueeze", [self.positions, self.i64([1])], "query_positions")
        key = self.op("Unsqueeze", [self.positions, self.i64([0])], "key_positions")
        return self.band(query, key, window)  # (P, P)

    def cache_slice(self, i, part, start, end):
        """`cache[i, part, :, start:end]` as `(B, end - start, H_kv, D)`."""
        starts = self.op("Concat", [self.i64([i, part]), start], "starts", axis=0)
        ends = self.op("Concat", [self.i64([i + 1, part + 1]), end], "ends", axis=0)
        sliced = self.op("Slice", ["cache", starts, ends, self.i64([0, 1, 3])], "cache_slice")
        return self.op("Squeeze", [sliced, self.i64([0, 1])], "cache_slice")

    def slot(self):
        """The slot `index` writes: `index mod cache_length` (ring) or `index`
        clamped into the cache (an unchecked bad request writes back what was there)."""
        def make():
            if self.ring:
                return self.op("Mod", [self.index, self.i64(self.cache_length)], "slot")
            return self.op("Min", [self.op("Max", [self.index, self.i64(0)], "clip"), self.last_slot()],
                           "clip")
        return self.g.once("slot", make)

    def kept(self, i, new, part):
        """With `checks="none"` an `index` outside a plain cache writes nothing (as
        `keras_attn.ops.cache.write_slot`): the slot's old value is written back."""
        if self.checks == "flag":
            return new
        inside = self.g.once("inside", lambda: self.op("And", [
            self.op("GreaterOrEqual", [self.index, self.i64(0)], "ge"),
            self.op("Less", [self.index, self.held()], "lt")], "inside"))
        slot = self.op("Reshape", [self.slot(), self.i64([1])], "slot")
        old = self.cache_slice(i, part, slot, self.op("Add", [slot, self.i64([1])], "slot_end"))
        return self.op("Where", [inside, new, old], "kept")

    def bounds(self, window):
        """`(start, end)` `(1,)` of the slots a decode query at `index` sees
        (`keras_attn.ops.cache.filled_part`), and the rows `(B, 2)` of the
        written slot in that slice."""
        def make():
            bucket, length = self.bucket, self.held()
            if bucket is None:  # every slot (what the bound is measured against)
                return self.slice_rows(self.i64(0), length, window)
            end = self.op("Min", [length, self.op("Mul", [self.op("Max", [
                self.op("Add", [self.op("Div", [self.index, self.i64(bucket)], "buckets"), self.i64(1)], "next"),
                self.i64(1)], "at_least_one"), self.i64(bucket)], "end")], "end")
            if window is None:
                start = self.i64(0)
            else:
                start = self.op("Max", [self.op("Sub", [self.index, self.i64(window - 1)], "first"), self.i64(0)],
                                "first")
                start = self.op("Min", [start, self.op("Sub", [end, self.i64(1)], "last")], "first")
                start = self.op("Mul", [self.op("Div", [start, self.i64(bucket)], "bucket"), self.i64(bucket)],
                                "start")
            return self.slice_rows(start, end, window)
        return self.g.once(("bounds", window), make)

    def slice_rows(self, start, end, window):
        """`(start, end)` as `(1,)`, the mask `(1, end - start)` of slots
        `[start, end)` and the rows `(B, 2)` of the written slot in them."""
        positions = self.op("Range", [start, end, self.i64(1)], "slice_positions")
        mask = self.op("Unsqueeze", [self.band(self.index, positions, window), self.i64([0])], "mask")
        start, end = (self.op("Reshape", [t, self.i64([1])], "bound") for t in (start, end))
        rows = self.op("Concat", [self.batch_rows(), self.op("Expand", [
            self.op("Sub", [self.slot(), start], "offset"), self.batch_column()], "offsets")], "rows", axis=1)
        return start, end, mask, rows

    def batch_rows(self):
        """`[[0], [1], ..., [B - 1]]` int64."""
        def make():
            batch = self.op("Squeeze", [self.batch_size()], "B")
            rows = self.op("Range", [self.i64(0), batch, self.i64(1)], "batch_range")
            return self.op("Unsqueeze", [rows, self.i64([1])], "batch_rows")
        return self.g.once("batch_rows", make)

    def batch_size(self):
        return self.g.once("batch", lambda: self.op("Shape", ["token_ids"], "batch", start=0, end=1))

    def batch_column(self):
        return self.g.once("batch_column", lambda: self.op(
            "Concat", [self.batch_size(), self.i64([1])], "batch_column", axis=0))

    def bounded_read(self, i, k, v, window):
        start, end, mask, rows = self.bounds(window)
        read = []
        for part, new in ((0, k), (1, v)):
            old = self.cache_slice(i, part, start, end)
            updates = self.op("Squeeze", [new, self.i64([1])], "new")
            read.append(self.op("ScatterND", [old, rows, updates], "write_slot"))
        return read[0], read[1], mask

    def ring_read(self, i, k, v, window):
        """The whole ring and the new key, as Keras reads them: slot `s` holds
        position `index - 1 - ((index - 1 - s) mod W)` (negative: never written)."""
        def mask():
            length = self.cache_length
            previous = self.op("Sub", [self.index, self.i64(1)], "previous")
            slots = self.i64(np.arange(length))
            held = self.op("Sub", [previous, self.op("Mod", [self.op("Sub", [previous, slots], "back"),
                                                              self.i64(length)], "mod")], "held")
            positions = self.op("Concat", [held, self.op("Reshape", [self.index, self.i64([1])], "new")],
                                "ring_positions", axis=0)
            seen = self.op("And", [self.band(self.index, positions, window),
                                   self.op("GreaterOrEqual", [positions, self.i64(0)], "written")], "seen")
            return self.op("Unsqueeze", [seen, self.i64([0])], "mask")

        start, end = self.i64([0]), self.i64([self.cache_length])
        keys = self.op("Concat", [self.cache_slice(i, 0, start, end), k], "ring_keys", axis=1)
        values = self.op("Concat", [self.cache_slice(i, 1, start, end), v], "ring_values", axis=1)
        return keys, values, self.g.once("ring_mask", mask)

    def attend(self, q, keys, values, mask, soft_cap):
        """softmax(q k^T / sqrt(D), masked) v for grouped heads: `q` `(B, T, H, D)`,
        `keys`/`values` `(B, S, H_kv, D)`, `mask` bool `(T, S)` -> `(B, T, H D)`."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        q = self.op("Mul", [q, self.f32(1.0 / math.sqrt(d))], "scaled_q")
        # (B, T, H_kv, G, D) -> (B, H_kv, G, T, D) -> (B, H_kv, G T, D)
        q = self.op("Reshape", [q, self.i64([0, 0, kv_heads, group, d])], "groups")
        q = self.op("Transpose", [q], "q_heads", perm=[0, 2, 3, 1, 4])
        q = self.op("Reshape", [q, self.i64([0, kv_heads, -1, d])], "q_rows")
        scores = self.op("MatMul", [q, self.op("Transpose", [keys], "k_t", perm=[0, 2, 3, 1])], "scores")
        if soft_cap is not None:
            scores = self.soft_cap(scores, soft_cap, "capped")
        if group > 1:
            mask = self.op("Tile", [mask, self.i64([group, 1])], "group_mask")
        scores = self.op("Where", [mask, scores, self.f32(MASKED_LOGIT)], "masked")
        probs = self.op("Softmax", [scores], "probs", axis=-1)
        out = self.op("MatMul", [probs, self.op("Transpose", [values], "v_t", perm=[0, 2, 1, 3])], "context")
        out = self.op("Reshape", [out, self.i64([0, kv_heads, group, -1, d])], "context_groups")
        out = self.op("Transpose", [out], "context_heads", perm=[0, 3, 1, 2, 4])
        return self.op("Reshape", [out, self.i64([0, 0, heads * d])], "context")

    # -- outputs --------------------------------------------------------------------------

    def head(self, h):
        if self.d.tied:
            logits = self.g.apply(h, self.tied, None, self.name("lm_head"))
        else:
            logits = self.linear(h, "lm_head", self.d.head, "lm_head")
        cap = self.d.final_logit_soft_cap
        return logits if cap is None else self.soft_cap(logits, cap, "final_soft_cap")

    def soft_cap(self, x, cap, hint):
        """`cap * tanh(x / cap)`, its last node named after `hint`."""
        cap = self.f32(cap)
        return self.g.soft_cap(x, cap, [self.name(h) for h in ("cap", "tanh", hint)])

    def cache_out(self, new_keys_values):
        """prefill: the cache of this block; decode: the input cache with this
        call's slot written (one ScatterND for every layer); decode_step:
        this call's slot alone."""
        n, length = len(new_keys_values), self.cache_length
        stacked = self.op("Concat", [self.op("Unsqueeze", [t, self.i64([0])], "layer_kv")
                                     for pair in new_keys_values for t in pair], "stacked", axis=0)
        if self.step:  # (2N, B, 1, H_kv, D)
            return self.op("Reshape", [stacked, self.i64([n, 2, -1, 1, self.kv_heads, self.head_dim])],
                           "new_cache")
        if self.kind == "prefill":
            # (2N, B, P, H_kv, D) -> the slots: slot s holds position src[s].
            slots = self.i64(np.arange(length))
            last = self.op("Sub", [self.length, self.i64([1])], "last")
            if self.ring:
                src = self.op("Sub", [last, self.op("Mod", [self.op("Sub", [last, slots], "back"),
                                                             self.i64(length)], "mod")], "source")
                inside = self.op("GreaterOrEqual", [src, self.i64(0)], "inside")
            else:
                src = slots
                inside = self.op("LessOrEqual", [slots, last], "inside")
            src = self.op("Min", [self.op("Max", [src, self.i64(0)], "clip"), last], "clip")
            gathered = self.op("Gather", [stacked, src], "placed", axis=2)
            inside = self.op("Reshape", [inside, self.i64([1, 1, length, 1, 1])], "inside")
            placed = self.op("Where", [inside, gathered, self.f32(0.0)], "cache")
            return self.op("Reshape", [placed, self.i64([n, 2, -1, length, self.kv_heads, self.head_dim])],
                           "cache")
        updates = self.op("Reshape", [stacked, self.i64([n, 2, -1, self.kv_heads, self.head_dim])], "updates")
        shape = self.op("Concat", [self.i64([n, 2]), self.batch_size(), self.i64([1])], "index_shape", axis=0)
        layer_part = np.stack(np.meshgrid(np.arange(n), np.arange(2), indexing="ij"), axis=-1)  # (N, 2, 2)
        fixed = self.op("Expand", [self.i64(layer_part.reshape(n, 2, 1, 2)), self.op(
            "Concat", [self.i64([n, 2]), self.batch_size(), self.i64([2])], "fixed_shape", axis=0)], "fixed")
        rows = self.op("Expand", [self.op("Reshape", [self.batch_rows(), self.i64([1, 1, -1, 1])], "rows"), shape],
                       "rows")
        slot = self.op("Expand", [self.op("Reshape", [self.slot(), self.i64([1, 1, 1, 1])], "slot"), shape], "slots")
        indices = self.op("Concat", [fixed, rows, slot], "indices", axis=-1)
        return self.op("ScatterND", ["cache", indices, updates], "cache_out")
