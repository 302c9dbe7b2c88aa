"""TFLite of a Transformer encoder written from the Keras weights (the direct writer).

TensorFlow's converter (`tflite.convert`: a SavedModel, then MLIR) holds the
weights many times over while it works: about 8-10x them at its peak on a
converted BERT (benchmarks/RESULTS.md, "Real sizes (issue 36): encoder
exports"). `write_encoder_tflite` instead reads the model's description
(`keras_attn.description.read_encoder`) and writes each step op by op with
the builtin ops the converter emits for it, each weight once (read as a view
of its variable), streamed to the file as it is made (`tflite_writer`).
`tflite.export_tflite` uses it wherever it covers the model (`writer="auto"`):
what the direct ONNX writer covers but negative indices and inputs of other
ranks than `(batch, length)` and float `(batch, length, features)` (the
capability table, `keras_attn.export.capabilities`, "tflite_encoder");
anything else raises `NotFusableError` with the table's reason.

The graph is the converter's: the signature `serving_default` with the
model's input names (`serving_default_<name>:0` tensors) and output names
(`StatefulPartitionedCall:<k>`), dynamic batch and sequence axes; the
sequence runs as `(batch * length, features)` rows through FULLY_CONNECTED;
LayerNorm as the converter emits Keras's; attention as BATCH_MATMUL, the
masked logits' bias ADD, SOFTMAX, BATCH_MATMUL, with query rows that see no
key zeroed (as Keras's attention does) rather than NaN; a sentence
embedding's pooling as masked sums over the tokens. The `1/sqrt(head_size)`
query scale is folded into the query weights (exact in real arithmetic).
The integer inputs that feed an embedding are clamped into range at the
graph's entry (`check_ids="clamp"`), and flagged with a `valid` output
(`"flag"`), as `saved_model.serving_function` does for the converter.

Weights are float32, or with `quantization="dynamic"` int8 per output
channel with LiteRT's hybrid FULLY_CONNECTED (`asymmetric_quantize_inputs`),
and the token table int8 per row (GATHER, CAST, MUL by the rows' scales).
"""

import collections

import numpy as np

from keras_attn import description as description_lib
from keras_attn.export import capabilities
from keras_attn.export import saved_model as saved_model_lib
from keras_attn.export import tflite_decoder
from keras_attn.export import tflite_writer
from keras_attn.export.capabilities import NotFusableError
from keras_attn.export.tflite_writer import quantize_rows
from keras_attn.layers.sentence_pooling import MIN_COUNT
from keras_attn.ops.masking import MASKED_LOGIT

QUANTIZATIONS = (None, "dynamic")
ID_CHECKS = (None, "clamp", "flag")
SIGNATURE_KEY = "serving_default"
# See `meant_for`: 16.8M parameters, 64 MiB of float32 (BERT-base: 110M).
MEANT_FOR_PARAMETERS = 1 << 24
# A description value's tensor, and for a `(B, T, ...)` tensor kept as
# `(B * T, ...)` rows, the `(2,)` int32 shape `(B, T)` (else None).
Value = collections.namedtuple("Value", "index rows")
# The steps whose output keeps the rows of their input (`_EncoderBuilder.row_wise`).
_ROW_WISE = (description_lib.ArithmeticStep, description_lib.NormStep, description_lib.DenseStep,
             description_lib.CompareStep, description_lib.NormalizeStep, description_lib.TruncateStep)


def meant_for(model):
    """True when `model` is one the direct writer is meant for: it holds a
    `TransformerEncoderBlock` and at least `MEANT_FOR_PARAMETERS` weights (64
    MiB in float32), where the converter's 8-10x the weights starts to
    count. `export_tflite` warns when it falls back to the converter for
    such a model, and stays quiet for the others (a small classifier
    converts in seconds either way)."""
    from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

    layers = getattr(model, "layers", [])
    if not any(isinstance(layer, TransformerEncoderBlock) for layer in layers):
        return False
    return sum(int(np.prod(w.shape)) for w in model.weights) >= MEANT_FOR_PARAMETERS


def write_encoder_tflite(model, path, *, quantization=None, check_ids="clamp"):
    """Writes `model` (a functional Keras encoder) as a `.tflite` file at `path`.

    Args:
        model: a functional Keras model the capability table says the
            writer covers.
        path: the `.tflite` file to write (replaced).
        quantization: None (float32) or "dynamic" (int8 weights).
        check_ids: None, "clamp" or "flag" (see `tflite.export_tflite`).

    Returns:
        `{"buffers": n, "weight_bytes": bytes after the flatbuffer,
        "flatbuffer_bytes": n}`.

    Raises:
        NotFusableError: a layer, setting or option the writer does not cover
            (the capability table's reason, `keras_attn.export.capabilities`,
            writer "tflite_encoder").
    """
    encoder = capabilities.checked(model, "tflite_encoder", options=[
        ("quantization", quantization, QUANTIZATIONS), ("check_ids", check_ids, ID_CHECKS)])
    if check_ids == "flag" and saved_model_lib.VALID_OUTPUT in [t.name for t in encoder.outputs]:
        raise NotFusableError(f"check_ids='flag' and an output named {saved_model_lib.VALID_OUTPUT!r}")

    def build(writer):
        return [_EncoderBuilder(writer, quantization == "dynamic").build(encoder, check_ids)]

    return tflite_writer.write_model(path, build, "keras_attn direct TFLite encoder")


class _EncoderBuilder:
    """The subgraph under construction; `values`: each description value's `Value`."""

    def __init__(self, writer, int8):
        self.g = tflite_writer.Graph(writer, SIGNATURE_KEY)
        self.quantization = "dynamic" if int8 else None
        self.values = {}

    # -- small helpers ------------------------------------------------------
    def const(self, value, dtype):
        return self.g.const(np.asarray(value, dtype))

    def dims(self, rows):
        """`(B, T)` as `(1,)` int32 tensors, from a `(2,)` shape."""
        return self.g.cached(("dims", rows), lambda: [self.g.slice(rows, [i], [1], (1,)) for i in (0, 1)])

    def shape_of(self, rows, *parts):
        """An int32 shape vector of `parts`: "B", "T" (from `rows`) or ints."""
        def make():
            b, t = self.dims(rows)
            pieces = [{"B": b, "T": t}[d] if isinstance(d, str) else self.const([d], np.int32)
                      for d in parts]
            return self.g.concat(pieces, 0)
        return self.g.cached(("shape", rows) + parts, make)

    def reshape(self, x, shape_tensor, static):
        return self.g.op("RESHAPE", [x, shape_tensor], static, self.g.dtype(x))

    def unflatten(self, value):
        """A value's tensor with its `(B, T)` axes back."""
        if value.rows is None:
            return value.index
        x = value.index
        return self.reshape(x, self.shape_of(value.rows, "B", "T", *self.g.shape(x)[1:]),
                            (None, None) + self.g.shape(x)[1:])

    # -- layers ---------------------------------------------------------------
    def fully_connected(self, x, make_kernel, bias, name):
        """`x (N, K) @ kernel (K, M) + bias`, `make_kernel()` float32 NumPy."""
        g = self.g
        return g.fully_connected(x, g.fc_weight(name, make_kernel, name + "/weight", self.quantization),
                                 None if bias is None else np.asarray(bias, np.float32), name, name)

    def dense(self, x, dense, activation, name):
        """`activation(x @ kernel + bias)` of a description's `Dense`."""
        return self.g.activation(self.fully_connected(x, dense.kernel.read, dense.read_bias(), name), activation)

    def norm(self, x, norm):
        """A described `Norm` over the last axis: RMSNorm, or LayerNorm
        `(x - mean) * rsqrt(var + eps) * gamma (+ beta)`."""
        g = self.g
        if norm.kind == "rms":
            return g.mul(tflite_decoder.rms(g, x, norm.epsilon), self.const(norm.scale.read(), np.float32))
        axis = self.const([-1], np.int32)
        reduced = g.shape(x)[:-1] + (1,)
        mean = g.op("MEAN", [x, axis], reduced, np.float32, "ReducerOptions", keepDims=True)
        square = g.binary("SQUARED_DIFFERENCE", x, mean)
        var = g.op("MEAN", [square, axis], reduced, np.float32, "ReducerOptions", keepDims=True)
        var = g.add(var, self.const(norm.epsilon, np.float32))
        scale = g.op("RSQRT", [var], reduced)
        centered = g.binary("SUB", x, mean)
        y = g.mul(g.mul(centered, scale), self.const(norm.scale.read(), np.float32))
        return y if norm.bias is None else g.add(y, self.const(norm.bias.read(), np.float32))

    def lookup(self, table, ids, name, wrap, int8=False):
        """Rows of `table` `(V, D)` at `ids`; `wrap`: negative ids count from
        the end (as Keras's Embedding reads them)."""
        g = self.g
        if wrap:
            negative = g.binary("LESS", ids, self.const(0, np.int32))
            shifted = g.add(ids, self.const(table.shape[0], np.int32))
            ids = g.op("SELECT_V2", [negative, shifted, ids], g.shape(ids), np.int32,
                       "SelectV2Options")
        if not int8:
            return g.gather(g.const(table, name), ids)
        codes, scales = quantize_rows(table)
        return g.gather_int8(g.const(codes, name + "/codes"), scales, ids, name)

    def rows_of(self, ids):
        """The `(2,)` shape `(B, T)` of `(B, T)` ids."""
        return self.g.cached(("rows", ids), lambda: self.g.dims(ids))

    def embedding(self, step, ids, types_, clamped):
        g = self.g
        rows = self.rows_of(ids)
        x = self.lookup(step.tokens.read(), ids, step.name + "/tokens", wrap=not clamped,
                        int8=self.quantization is not None)
        positions = step.positions.table.read()
        _, t = self.dims(rows)
        size = g.concat([t, self.const([-1], np.int32)], 0)
        pos = g.slice(g.const(positions, step.name + "/positions"), [0, 0], size, (None, positions.shape[1]))
        x = g.add(x, pos)
        if step.types is not None:
            table = step.types.read()
            if types_ is None:
                x = g.add(x, g.const(table[0], step.name + "/type0"))
            else:
                x = g.add(x, self.lookup(table, types_, step.name + "/types", wrap=True))
        x = g.reshape(x, (-1, positions.shape[1]))
        if step.norm is not None:
            x = self.norm(x, step.norm)
        return Value(x, rows)

    def positions(self, rows):
        """The int32 positions `0 .. T - 1` `(T,)`."""
        def make():
            _, t = self.dims(rows)
            return self.g.op("RANGE", [self.const(0, np.int32), self.g.reshape(t, ()), self.const(1, np.int32)],
                             (None,), np.int32)
        return self.g.cached(("positions", rows), make)

    def attention_masks(self, padding, rows, causal, queries, window):
        """`(bias, keep)`: the additive logits bias `(B|1, 1, T|1, T)` (0 where
        a key is seen, MASKED_LOGIT elsewhere, 0 on rows that see no key) and
        the float `(B, 1, T|1, 1)` factor zeroing those rows and, with
        `queries`, the padded query rows (None when nothing is zeroed). A
        window is the symmetric band `|i - j| < window`, one per window."""
        return self.g.cached(("masks", padding, rows, causal, queries, window),
                             lambda: self._attention_masks(padding, rows, causal, queries, window))

    def _attention_masks(self, padding, rows, causal, queries, window):
        g = self.g
        mask = None
        if padding is not None:
            if g.dtype(padding) != np.bool_:
                padding = g.binary("NOT_EQUAL", padding, self.const(0, g.dtype(padding)))
            mask = self.reshape(padding, self.shape_of(rows, "B", 1, 1, "T"), (None, 1, 1, None))
        if causal or window is not None:
            steps = self.positions(rows)
            keys, queries_ = g.reshape(steps, (1, 1, 1, -1)), g.reshape(steps, (1, 1, -1, 1))
            bands = [g.binary("LESS_EQUAL", keys, queries_)] if causal else []
            if window is not None:  # |query - key| < window
                limit = self.const(window, np.int32)
                bands += [g.binary("LESS", g.binary("SUB", queries_, keys), limit),
                          g.binary("LESS", g.binary("SUB", keys, queries_), limit)]
            for band in bands:
                mask = band if mask is None else g.binary("LOGICAL_AND", mask, band)
        bias = g.op("SELECT_V2", [mask, self.const(0.0, np.float32),
                                  self.const(MASKED_LOGIT, np.float32)],
                    g.shape(mask), np.float32, "SelectV2Options")
        keep = None
        if padding is not None:
            axis = self.const([-1], np.int32)
            seen = g.op("REDUCE_ANY", [mask, axis], g.shape(mask)[:-1] + (1,), np.bool_,
                        "ReducerOptions", keepDims=True)
            bias = g.op("SELECT_V2", [seen, bias, self.const(0.0, np.float32)], g.shape(bias),
                        np.float32, "SelectV2Options")
            keep = g.op("CAST", [seen], g.shape(seen), np.float32, "CastOptions")
            if queries:
                query_rows = g.op("CAST", [padding], g.shape(padding), np.float32, "CastOptions")
                query_rows = self.reshape(query_rows, self.shape_of(rows, "B", 1, "T", 1), (None, 1, None, 1))
                keep = g.mul(keep, query_rows)
        return bias, keep

    def block(self, step, x, padding):
        """A `BlockStep` over `x` (a sequence: the capability table lets no
        other tensor of rank 3 in)."""
        g = self.g
        a, f, name = step.layer.attention, step.layer.feedforward, step.name
        heads, kv_heads, head = a.num_heads, a.num_key_value_heads, a.head_dim
        width, kv_width = heads * head, kv_heads * head
        rows = x.rows
        scale = np.float32(1.0 / np.sqrt(head))
        # The query scale is folded into the query weights, or with QK-norm
        # (which a scale before it would not survive) into the norm's output.
        after_norm, scale = (scale, np.float32(1.0)) if a.query_norm is not None else (None, scale)

        def qkv_kernel():
            kernel = a.packed_kernel()
            kernel[:, :width] *= scale
            return kernel

        qkv_bias = a.packed_bias()
        if qkv_bias is None:  # no biases: a zero one, the graph this writer has always written
            qkv_bias = np.zeros(width + 2 * kv_width, np.float32)
        qkv_bias[:width] *= scale
        bias, keep = None, None
        if padding is not None or step.causal or a.window is not None:
            bias, keep = self.attention_masks(padding, rows, step.causal,
                                              padding is not None and step.mask_padded_queries, a.window)
        widths = (width, kv_width, kv_width)

        def attention(h):
            q, k, v = g.split(self.fully_connected(h, qkv_kernel, qkv_bias, f"{name}/qkv"), list(widths))
            q, k, v = (self.reshape(t, self.shape_of(rows, "B", "T", n, head), (None, None, n, head))
                       for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))  # (B, T, H, d)
            if a.query_norm is not None:  # QK-norm: over each head, before the rotation
                q = g.mul(self.norm(q, a.query_norm), self.const(after_norm, np.float32))
                k = self.norm(k, a.key_norm)
            if a.rotary is not None:  # the query scale folded in commutes with the rotation
                cos, sin = tflite_decoder.rotary_angles(g, a.rotary, self.positions(rows))
                q, k = (tflite_decoder.rotate(g, t, cos, sin) for t in (q, k))
            if kv_heads != heads:  # query head i reads key/value head i // group
                k, v = (self.repeat_heads(t, rows, kv_heads, heads // kv_heads, head) for t in (k, v))
            q = g.transpose(q, (0, 2, 1, 3))  # (B, H, T, d)
            k = g.transpose(k, (0, 2, 3, 1))  # (B, H, d, T)
            v = g.transpose(v, (0, 2, 1, 3))  # (B, H, T, d)
            scores = g.op("BATCH_MATMUL", [q, k], (None, heads, None, None), np.float32,
                          "BatchMatMulOptions")
            if bias is not None:
                scores = g.add(scores, bias)
            probs = g.op("SOFTMAX", [scores], g.shape(scores), np.float32, "SoftmaxOptions",
                         beta=1.0)
            out = g.op("BATCH_MATMUL", [probs, v], (None, heads, None, head), np.float32,
                       "BatchMatMulOptions")
            if keep is not None:
                out = g.mul(out, keep)
            out = g.reshape(g.transpose(out, (0, 2, 1, 3)), (-1, width))
            return self.fully_connected(out, a.output.kernel.read, a.output.read_bias(),
                                        f"{name}/attention_output")

        def feedforward(h):
            if f.gate is not None:
                h = g.mul(self.dense(h, f.gate, f.activation, f"{name}/gate"), self.dense(h, f.up, "linear", f"{name}/ffn1"))
            else:
                h = self.dense(h, f.up, f.activation, f"{name}/ffn1")
            return self.dense(h, f.down, "linear", f"{name}/ffn2")

        h = x.index
        layer = step.layer
        for fn, norm, post_norm in ((attention, layer.attention_norm, layer.attention_post_norm),
                                    (feedforward, layer.feedforward_norm, layer.feedforward_post_norm)):
            if step.normalize_first:  # h + post_norm(f(norm(h))), a missing norm none
                y = fn(h if norm is None else self.norm(h, norm))
                h = g.add(h, y if post_norm is None else self.norm(y, post_norm))
            else:
                h = self.norm(g.add(h, fn(h)), norm)
        return Value(h, rows)

    def repeat_heads(self, x, rows, kv_heads, group, head):
        """`(B, T, H_kv, d)` -> `(B, T, H_kv * group, d)`, each head `group` times in a row."""
        g = self.g
        x = self.reshape(x, self.shape_of(rows, "B", "T", kv_heads, 1, head), (None, None, kv_heads, 1, head))
        x = g.concat([x] * group, 3)
        return self.reshape(x, self.shape_of(rows, "B", "T", kv_heads * group, head),
                            (None, None, kv_heads * group, head))

    def reduce(self, op, x, axis, keepdims):
        """`op` (SUM, REDUCE_MAX) of `x` over `axis`."""
        shape = list(self.g.shape(x))
        axis %= len(shape)
        shape[axis] = 1
        if not keepdims:
            del shape[axis]
        return self.g.op(op, [x, self.const([axis], np.int32)], tuple(shape), self.g.dtype(x),
                         "ReducerOptions", keepDims=keepdims)

    def pooling(self, step, hidden, mask):
        """A `PoolingStep` (modes of `capabilities.POOLING_MODES`) of the
        sequence `hidden` (a value kept as rows) as masked sums over the
        tokens, as `SentencePooling` computes them; `(B, D * modes)`."""
        g = self.g
        h = self.unflatten(hidden)  # (B, T, D)
        if g.dtype(mask) != np.bool_:
            mask = g.binary("NOT_EQUAL", mask, self.const(0, g.dtype(mask)))
        tokens = g.op("CAST", [mask], g.shape(mask), np.float32, "CastOptions")  # (B, T)
        one = self.const(1.0, np.float32)
        axis = self.const(1, np.int32)

        def cumsum(x):
            return g.op("CUMSUM", [x, axis], g.shape(x), np.float32, "CumsumOptions")

        def equal(a, b):
            same = g.binary("EQUAL", a, b)
            return g.op("CAST", [same], g.shape(same), np.float32, "CastOptions")

        def take(selected):  # the sum of the tokens where `selected` (B, T) is 1
            selected = g.op("EXPAND_DIMS", [selected, self.const(-1, np.int32)], g.shape(selected) + (1,),
                            g.dtype(selected), "ExpandDimsOptions")  # (B, T, 1)
            return self.reduce("SUM", g.mul(h, selected), 1, False)

        counted = cumsum(tokens)  # tokens up to each position
        count = self.reduce("SUM", tokens, 1, True)  # (B, 1)
        vectors = []
        for mode in step.modes:
            if mode == "cls":  # the first token; token 0 in a row without one
                selected = g.mul(equal(counted, one), tokens)
                none = g.binary("SUB", one, self.reduce("REDUCE_MAX", selected, 1, True))
                position0 = equal(cumsum(g.add(g.mul(tokens, self.const(0.0, np.float32)), one)), one)
                vectors.append(take(g.add(selected, g.mul(none, position0))))
            elif mode == "lasttoken":  # the last token; zeros in a row without one
                vectors.append(take(g.mul(equal(counted, count), tokens)))
            else:  # "mean", "mean_sqrt_len_tokens"
                total = take(tokens)
                divisor = g.binary("MAXIMUM", count, self.const(MIN_COUNT, np.float32))
                if mode == "mean_sqrt_len_tokens":
                    divisor = g.op("SQRT", [divisor], g.shape(divisor))
                vectors.append(g.binary("DIV", total, divisor))
        return vectors[0] if len(vectors) == 1 else g.concat(vectors, -1)

    def row_wise(self, step, x):
        """The tensor of a step of `_ROW_WISE` over `x`: its rows stay the input's."""
        g = self.g
        if isinstance(step, description_lib.ArithmeticStep):
            other = self.values[step.other].index if step.other is not None else self.const(step.scalar, np.float32)
            return g.binary({"add": "ADD", "multiply": "MUL"}[step.op], x, other)
        if isinstance(step, description_lib.NormStep):
            return self.norm(x, step.norm)
        if isinstance(step, description_lib.DenseStep):
            return self.dense(x, step.dense, step.activation, step.name)
        if isinstance(step, description_lib.CompareStep):
            return g.binary("EQUAL" if step.equal else "NOT_EQUAL", x, self.const(step.scalar, g.dtype(x)))
        if isinstance(step, description_lib.NormalizeStep):  # x * min(rsqrt(sum(x ** 2)), 1 / epsilon)
            inverse = g.op("RSQRT", [self.reduce("SUM", g.mul(x, x), -1, True)], g.shape(x)[:-1] + (1,))
            return g.mul(x, g.binary("MINIMUM", inverse, self.const(1.0 / step.epsilon, np.float32)))
        rank = len(g.shape(x))  # TruncateStep: the first `step.size` features
        return g.op("SLICE", [x, self.const([0] * rank, np.int32), self.const([-1] * (rank - 1) + [step.size], np.int32)],
                    g.shape(x)[:-1] + (step.size,), g.dtype(x), "SliceOptions")

    # -- the model ------------------------------------------------------------
    def inputs(self, encoder, check_ids):
        """The graph inputs (sorted by name, as the converter's signature
        lists them), and the values the model reads: the embedded ids
        clamped for "clamp"/"flag", and the `valid` output for "flag"."""
        g = self.g
        graph_inputs = {}
        valid = None
        for tensor in encoder.inputs:
            name = tensor.name
            index = g.tensor(f"{SIGNATURE_KEY}_{name}:0", (None,) + tuple(tensor.shape[1:]),
                             np.dtype(tensor.dtype))
            graph_inputs[name] = index
            rows = None
            if len(tensor.shape) == 3 and tensor.dtype == "float32":
                # Features in: kept as (B * T, D) rows like every sequence.
                rows = g.dims(index, 0, 2)
                index = g.reshape(index, (-1, tensor.shape[2]))
            elif check_ids and tensor.vocabulary is not None:
                vocab = tensor.vocabulary
                clamped = g.binary("MAXIMUM", g.binary("MINIMUM", index, self.const(vocab - 1, np.int32)),
                                   self.const(0, np.int32))
                if check_ids == "flag":
                    same = g.binary("EQUAL", clamped, index)
                    same = g.op("CAST", [same], g.shape(same), np.int32, "CastOptions")
                    row = g.op("REDUCE_MIN", [same, self.const([1], np.int32)],
                               (g.shape(same)[0],), np.int32, "ReducerOptions", keepDims=False)
                    valid = row if valid is None else g.binary("MINIMUM", valid, row)
                index = clamped
            self.values[tensor.value] = Value(index, rows)
        if check_ids == "flag":
            if valid is None:  # no embedded input: every row is valid
                first = graph_inputs[encoder.inputs[0].name]
                valid = g.op("FILL", [g.dims(first, 0, 1), self.const(True, np.bool_)], (None,), np.bool_)
            else:
                valid = g.binary("GREATER", valid, self.const(0, np.int32))
        return dict(sorted(graph_inputs.items())), valid

    def build(self, encoder, check_ids):
        g = self.g
        graph_inputs, valid = self.inputs(encoder, check_ids)
        clamped = {t.value for t in encoder.inputs if check_ids and t.vocabulary is not None}
        v = self.values
        for step in encoder.steps:
            x = v[step.input]
            if isinstance(step, description_lib.BlockStep):
                result = self.block(step, x, None if step.padding is None else v[step.padding].index)
            elif isinstance(step, description_lib.EmbeddingStep):
                types_ = None if step.type_ids is None else v[step.type_ids].index
                result = self.embedding(step, x.index, types_, step.input in clamped)
            elif isinstance(step, description_lib.LookupStep):
                rows = self.lookup(step.table.read(), x.index, step.name, wrap=step.input not in clamped,
                                   int8=self.quantization is not None)
                result = Value(g.reshape(rows, (-1, step.table.shape[1])), self.rows_of(x.index))
            elif isinstance(step, description_lib.PoolingStep):
                result = Value(self.pooling(step, x, self.unflatten(v[step.mask])), None)
            elif isinstance(step, description_lib.GetItemStep):
                index = self.unflatten(x)
                for axis in reversed(range(len(step.key))):
                    if step.key[axis] is not None:
                        index = g.gather(index, self.const(step.key[axis], np.int32), axis=axis)
                result = Value(index, None)
            elif isinstance(step, _ROW_WISE):
                result = Value(self.row_wise(step, x.index), x.rows)
            else:  # a Step as it is
                result = x
            v[step.output] = result
        outputs = []
        taken = set(graph_inputs.values())
        for tensor in encoder.outputs:
            index = self.unflatten(v[tensor.value])
            if index in taken:  # an input or another output: a copy of its own
                index = self.reshape(index, g.dims(index), g.shape(index))
            taken.add(index)
            outputs.append((tensor.name, index))
        if valid is not None:
            outputs.append((saved_model_lib.VALID_OUTPUT, valid))
        return g.finish(list(graph_inputs.items()), outputs, "StatefulPartitionedCall:{k}", "main")
