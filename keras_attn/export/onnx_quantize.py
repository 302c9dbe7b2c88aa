"""Integer weights for ONNX graphs, with answers that do not depend on the CPU.

onnxruntime's dynamic quantization turns a `MatMul` with a constant weight
into `DynamicQuantizeMatMul` / `MatMulInteger`: the activations become uint8
at run time, the weights int8. On x86 CPUs with AVX2 or AVX-512 but no VNNI
(many servers and laptops), onnxruntime multiplies those with VPMADDUBSW,
which adds two uint8 x int8 products into a *saturating* int16. With full
int8 weights two products reach 2 * 255 * 127 = 64770 > 32767, the sum is
clipped, and the model gives other answers there than on a CPU with VNNI, an
SSE-only CPU or ARM, whose kernels add in int32 (the next-token agreement
of a trained decoder with float32 falls by about a tenth on such a CPU:
benchmarks/RESULTS.md, "int8 ONNX schemes").

`quantize_matmul_weights` keeps the weights within 7 bits (`reduce_range`:
int8 values in [-64, 64]), so that no pair of products can pass 2 * 255 * 64
= 32640: the integer arithmetic is exact, hence the same, on every
instruction set. It costs one bit of weight precision and keeps
onnxruntime's fastest int8 kernels (VNNI where the CPU has it).
`check_no_int8_saturation` states the rule on a graph.

The activations are quantized with one uint8 scale per tensor
(`DynamicQuantizeLinear`), which a few large values set for all the others.
In BERT-style encoders those are the first token's ([CLS], the "massive
activations" of an attention sink) and the delimiters', and they sit in a
few fixed channels: in all-MiniLM-L6-v2 the largest |input| of the
feed-forward up projections of layers 0-4 is 22-30, in channel 99, at
token 0, against a median row maximum of 4-8 over the other tokens (40 real
sentences), so every other token got a fraction of the resolution; that,
more than the 7-bit weights, took its sentence-embedding cosine to 0.988
(per-tensor activations alone: 0.992; 7-bit weights alone: 0.997).

By default `quantize_matmul_weights` (and `export_onnx(quantization=
"dynamic")`) quantizes the first token's row apart from the rest
(`first_token_apart`): two integer MatMuls on one int8 weight, their own
activation scales, the rows concatenated back. On all-MiniLM-L6-v2 the
lowest cosine is then 0.993 one sentence per call (0.992 on the shortest,
four-token sentences); in a padded batch the other sentences' delimiters
still share one scale (0.990-0.991). It costs time: each split MatMul reads
its whole weight once more for the one row, which shows most on short
inputs, and its `Slice`s and `Concat` add three nodes.

With `calibration` (input sets to run the float32 graph on) it applies
SmoothQuant (Xiao et al., 2023) instead: each MatMul input whose channels
reach past its typical row gets its outlier channels divided by a factor
and the weight's rows multiplied by it (the same product, with the range
carried by the weights' per-column scales), folded into the norm that makes
the input where nothing else reads it (pre-norm blocks: no extra op), else
one `Mul`. Each projection stays one integer MatMul, at about the speed of
one scale per tensor, closer than the split in padded batches; but
calibrated on random token ids, a four-token sentence (half of it [CLS]
and [SEP]) stays at 0.988 (benchmarks/RESULTS.md, "quantization_sentence_embedding", and
tests/convert/test_sentence_transformers.py).
`float_after_activation=True` keeps the MatMuls that read an activation
function's output (a feed-forward block's down projection, whose GELU
output has the longest tail) in float32: closer to float32, at a third of
the int8 MACs.

`matmul_nbits` writes onnxruntime's weight-only `MatMulNBits` (8 or 4 bits
in blocks along the input axis) instead. With `accuracy_level=4` the CPU
quantizes the activations to int8 per block where it has AVX2/AVX-512/ARM
dot-product kernels and computes in float32 elsewhere (SSE-only CPUs), so
its answers move with the CPU within the quantization error.
"""

import concurrent.futures
import os

import numpy as np

# VPMADDUBSW adds two uint8 x int8 products into an int16.
INT16_MAX = 32767
UINT8_MAX = 255
# The largest |int8 weight| for which 2 * 255 * |w| fits an int16.
SAFE_INT8_WEIGHT = INT16_MAX // (2 * UINT8_MAX)  # 64


def quantize_matmul_weights(proto, *, calibration=None, first_token_apart=None, float_after_activation=False,
                            inplace=False):
    """int8 weights (per output channel, 7-bit range) for every `MatMul` of
    `proto` whose weight is a constant 2-D float32 tensor; activations are
    quantized at run time.

    The graph is what onnxruntime's `quantize_dynamic(per_channel=True,
    reduce_range=True, weight_type=QInt8, MatMulConstBOnly)` writes
    (`DynamicQuantizeLinear`, `MatMulInteger`, `Cast`, two `Mul`s, which
    onnxruntime fuses when it loads the model), written here weight by
    weight: each float32 weight is let go as soon as its int8 copy exists,
    so the peak holds the graph once, not the three copies the quantizer's
    protobuf round trips made (tests/export/test_onnx_quantization.py checks
    the weights and the answers against `quantize_dynamic`'s).

    Args:
        proto: an ONNX `ModelProto` in float32.
        calibration: None, or input sets (a `{graph input name: array}`
            dict or a list of them) to run the float32 graph on: each
            MatMul input whose channels reach past `OUTLIER_RATIO` times
            its typical row maximum is smoothed (see the module docstring).
            Inputs like the ones served (token ids of the served lengths)
            calibrate best.
        first_token_apart: quantize the activations of the first token (row
            0 along the second-to-last axis: the token axis of a `(batch,
            tokens, features)` input) with their own scale, apart from the
            other tokens' (see the module docstring: the outliers of an
            encoder's first token). The answer is the same arithmetic on
            each row; it costs a `Slice` pair and a `Concat` per MatMul.
            None (default): when no `calibration` is given. False: one scale
            per activation tensor (a decoder's token-by-token steps, whose
            first row is no such token).
        float_after_activation: True: a `MatMul` whose input is an
            activation function's output (GELU, SiLU: the `Erf`, `Tanh` or
            `Sigmoid` arithmetic, or onnxruntime's `Gelu`, `BiasGelu`,
            `FastGelu`, `QuickGelu`) keeps its float32 weight: closer to
            float32, slower (see the module docstring).
        inplace: rewrite `proto` itself (its float32 weights are freed as
            they are quantized) rather than a copy of it.

    Returns:
        The quantized `ModelProto` (checked with `check_no_int8_saturation`).
    """
    import onnx

    for name, value in (("float_after_activation", float_after_activation), ("inplace", inplace)):
        if value not in (True, False):
            raise TypeError(f"Received an invalid value for argument `{name}`, expected True or "
                            f"False. Received: {name}={value!r}")
    if first_token_apart not in (None, True, False):
        raise TypeError("Received an invalid value for argument `first_token_apart`, expected None, True "
                        f"or False. Received: first_token_apart={first_token_apart!r}")
    calibration = _calibration_sets(calibration)
    if first_token_apart is None:
        first_token_apart = calibration is None
    if not inplace:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        proto = copy
    keep = _activation_fed_matmuls(proto) if float_after_activation else set()
    if calibration is not None:
        _smooth(proto, activation_ranges(proto, calibration), skip=keep)
    if first_token_apart:
        _first_token_apart(proto, skip=keep)
    _integer_matmuls(proto, skip=keep)
    check_no_int8_saturation(proto)
    return proto


def _int8_per_column(weight):
    """`(codes, scales)`: `weight` (K, N) as int8 codes in [-64, 64], one
    scale per column = max |w| / 64, rounded half to even, as onnxruntime's
    per-channel symmetric `reduce_range` quantizer computes them (an
    all-zero column gets the scale 1)."""
    top = np.float32(SAFE_INT8_WEIGHT)
    absmax = np.maximum(weight.max(0), -weight.min(0)).astype(np.float32)
    # onnxruntime's (rmax - rmin) / (qmax - qmin): 2 |w|max / 128, the same
    # float32 number as |w|max / 64.
    scales = (np.float32(2) * absmax) / np.float32(2 * SAFE_INT8_WEIGHT)
    scales = np.where(scales < np.finfo(np.float32).tiny, np.float32(1), scales).astype(np.float32)
    codes = np.rint(weight / scales)
    np.clip(codes, -top, top, out=codes)
    return codes.astype(np.int8), scales


def _integer_matmuls(proto, skip=()):
    """Every `MatMul` of `proto` with a constant 2-D float32 weight (but
    those named in `skip`) rewritten in place as onnxruntime's dynamic
    quantizer writes it, with its node and tensor names; each float32
    weight no other node reads is emptied once quantized and removed at
    the end."""
    from onnx import TensorProto, helper, numpy_helper

    graph = proto.graph
    positions = {t.name: i for i, t in enumerate(graph.initializer)}
    # The position of each node's weight among the initializers if it is rewritten, else None.
    rewritten = {i for i in _weighted_matmuls(proto) if graph.node[i].name not in skip}
    targets = [positions[node.input[1]] if i in rewritten else None for i, node in enumerate(graph.node)]
    # A float32 weight that some other node or a graph output also reads
    # stays as it is beside its int8 copy.
    also_read = {output.name for output in graph.output}
    for node, position in zip(graph.node, targets):
        also_read.update(node.input if position is None else node.input[:1])
    quantized, activations, emptied, nodes, added = set(), set(), [], [], []
    for node, position in zip(graph.node, targets):
        if position is None:
            nodes.append(node)
            continue
        tensor = graph.initializer[position]
        x, w = node.input
        (y,) = node.output
        if w not in quantized:
            codes, scales = _int8_per_column(numpy_helper.to_array(tensor))
            added += [numpy_helper.from_array(codes, f"{w}_quantized"),
                      numpy_helper.from_array(scales, f"{w}_scale"),
                      numpy_helper.from_array(np.zeros(scales.shape, np.int8), f"{w}_zero_point")]
            del codes
            if w not in also_read:
                tensor.ClearField("raw_data")
                tensor.ClearField("float_data")
                emptied.append(position)
            quantized.add(w)
        if x not in activations:
            nodes.append(helper.make_node("DynamicQuantizeLinear", [x],
                                          [f"{x}_quantized", f"{x}_scale", f"{x}_zero_point"],
                                          name=f"{x}_QuantizeLinear"))
            activations.add(x)
        base = node.name
        nodes += [
            helper.make_node("Mul", [f"{x}_scale", f"{w}_scale"], [f"{base}_quant_scales_mul:0"],
                             name=f"{base}_quant_scales_mul"),
            helper.make_node("MatMulInteger",
                             [f"{x}_quantized", f"{w}_quantized", f"{x}_zero_point", f"{w}_zero_point"],
                             [f"{y}_output_quantized"], name=f"{base}_quant"),
            helper.make_node("Cast", [f"{y}_output_quantized"], [f"{y}_output_quantized_cast_output"],
                             name=f"{y}_output_quantized_cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{y}_output_quantized_cast_output", f"{base}_quant_scales_mul:0"],
                             [y], name=f"{base}_quant_output_scale_mul"),
        ]
    for position in sorted(emptied, reverse=True):
        del graph.initializer[position]
    graph.initializer.extend(added)
    del graph.node[:]
    graph.node.extend(nodes)
    return proto


# An input is smoothed when one of its channels reaches this many times the
# largest |value| of a typical row (the median row).
OUTLIER_RATIO = 1.0
# SmoothQuant's migration strength: how much of a channel's range moves
# into the weight's row.
SMOOTHING = 0.8
_NORMS = {"LayerNormalization": (1, 2), "SimplifiedLayerNormalization": (1,),
          "SkipLayerNormalization": (2, 3), "SkipSimplifiedLayerNormalization": (2,)}


def _calibration_sets(calibration):
    """`calibration` as a non-empty list of `{input name: array}` dicts, or None."""
    if calibration is None:
        return None
    sets = [calibration] if isinstance(calibration, dict) else calibration
    if not isinstance(sets, (list, tuple)) or not sets or not all(isinstance(s, dict) for s in sets):
        raise TypeError("Received an invalid value for argument `calibration`, expected None, a dict "
                        "of input arrays or a non-empty list of such dicts. Received: "
                        f"calibration of type {type(calibration).__name__}")
    return list(sets)


def _weighted_matmuls(proto):
    """The positions in `proto.graph.node` of the `MatMul`s whose weight
    (input 1) is a constant 2-D float32 tensor."""
    from onnx import TensorProto

    tensors = {t.name: t for t in proto.graph.initializer}
    return [i for i, node in enumerate(proto.graph.node) if node.op_type == "MatMul" and node.input[1] in tensors
            and tensors[node.input[1]].data_type == TensorProto.FLOAT and len(tensors[node.input[1]].dims) == 2]


def activation_ranges(proto, calibration):
    """`{input: (channel_max, typical)}` for each input of a `MatMul` with a
    constant weight in the float32 graph `proto`, run in onnxruntime on the
    `calibration` sets: the largest |value| of each channel (last axis)
    over every row of every set, and the median over the rows (all-zero
    rows, such as a padded query's, left out) of each row's largest |value|."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = proto.graph
    wanted = list(dict.fromkeys(graph.node[i].input[0] for i in _weighted_matmuls(proto)))
    outputs = len(graph.output)
    graph.output.extend(helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in wanted)
    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.add_session_config_entry("session.disable_prepacking", "1")
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    finally:
        del graph.output[outputs:]
    names = {i.name for i in session.get_inputs()}
    channel_max, row_max = {}, {x: [] for x in wanted}
    for feeds in calibration:
        missing = sorted(names - set(feeds))
        if missing:
            raise ValueError(f"Received an invalid `calibration`: each set must hold the graph's inputs "
                             f"{sorted(names)}. Received a set with keys {sorted(feeds)} (missing {missing})")
        values = session.run(wanted, {k: np.asarray(v) for k, v in feeds.items() if k in names})
        for x, value in zip(wanted, values):
            rows = np.abs(np.asarray(value, np.float32)).reshape(-1, value.shape[-1])
            top = rows.max(0) if rows.size else np.zeros(rows.shape[-1], np.float32)
            channel_max[x] = np.maximum(channel_max.get(x, top), top)
            row_max[x].append(rows.max(1) if rows.size else np.zeros(0, np.float32))
    ranges = {}
    for x in wanted:
        rows = np.concatenate(row_max[x])
        rows = rows[rows > 0]
        ranges[x] = (channel_max[x], float(np.median(rows)) if rows.size else 0.0)
    return ranges


def _smooth(proto, ranges, skip=()):
    """SmoothQuant (Xiao et al., 2023) on `proto`, in place: where a
    `MatMul` input's channels reach past `OUTLIER_RATIO` times its typical
    row maximum, the channels above the median are divided by `s = max|x_c|
    ^ SMOOTHING / max|W_c| ^ (1 - SMOOTHING)` (over the median of s) and the
    weights' rows multiplied by it: the same product in exact arithmetic,
    and the outliers' range moved into the per-column weight scales, so the
    one activation scale of a tensor fits its other values. The division is
    folded into the normalization (or the constant `Mul`) that makes the
    input where nothing else reads it, else written as a `Mul` node.
    Returns the inputs smoothed."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    tensors = {t.name: t for t in graph.initializer}
    # Nodes by their position in `graph.node`.
    readers, producers = {}, {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, []).append(i)
        for name in node.output:
            producers[name] = i
    outputs = {o.name for o in graph.output}
    consumers = {}
    for i in _weighted_matmuls(proto):
        if graph.node[i].name not in skip:
            consumers.setdefault(graph.node[i].input[0], []).append(i)
    inserted, smoothed = {}, []
    for x, mine in consumers.items():
        channel_max, typical = ranges.get(x, (None, 0.0))
        if channel_max is None or not channel_max.max() > OUTLIER_RATIO * typical:
            continue
        nodes = [graph.node[i] for i in mine]
        weights = list(dict.fromkeys(node.input[1] for node in nodes))
        if any(w in outputs or any(r not in mine for r in readers[w]) for w in weights):
            continue  # a weight some other node reads (a tied table) keeps its values
        arrays = [numpy_helper.to_array(tensors[w]) for w in weights]
        weight_max = np.max([np.abs(a).max(1) for a in arrays], axis=0)
        s = (np.maximum(channel_max, 1e-6) ** SMOOTHING / np.maximum(weight_max, 1e-6) ** (1 - SMOOTHING))
        s = np.maximum(s / np.median(s), 1.0).astype(np.float32)
        for w, array in zip(weights, arrays):
            tensors[w].CopyFrom(numpy_helper.from_array((array * s[:, None]).astype(np.float32), w))
        producer = graph.node[producers[x]] if x in producers else None
        if not _fold_division(x, s, producer, readers[x], mine, outputs, tensors, readers):
            name = f"{x}_smoothed"
            graph.initializer.append(numpy_helper.from_array((1 / s).astype(np.float32), name + "_divisor"))
            inserted[mine[0]] = helper.make_node("Mul", [x, name + "_divisor"], [name], name=name)
            for node in nodes:
                node.input[0] = name
        smoothed.append(x)
    if inserted:
        ordered = []
        for i, node in enumerate(graph.node):
            if i in inserted:
                ordered.append(inserted[i])
            ordered.append(node)
        del graph.node[:]
        graph.node.extend(ordered)
    return smoothed


def _fold_division(x, s, producer, x_readers, matmuls, outputs, tensors, readers):
    """Divides `x` by `s` inside its producer, a normalization with constant
    scale (and bias) or a `Mul` by a constant vector, when only the nodes
    at the positions `matmuls` read `x` (`x_readers`: the positions of its
    readers) and only the producer reads those constants. Returns whether
    it did."""
    from onnx import numpy_helper

    if producer is None or x in outputs or any(r not in matmuls for r in x_readers) or producer.output[0] != x:
        return False
    if producer.op_type == "Mul":  # by one constant
        names = [n for n in producer.input if n in tensors]
        names = names if len(names) == 1 else []
    else:  # a norm's scale (and bias)
        names = [producer.input[i] for i in _NORMS.get(producer.op_type, ())
                 if i < len(producer.input) and producer.input[i]]
    if not names or any(n not in tensors or len(readers[n]) != 1 for n in names):
        return False
    arrays = [numpy_helper.to_array(tensors[n]) for n in names]
    if any(a.size != s.size or a.shape[-1] != s.size for a in arrays):
        return False
    for n, a in zip(names, arrays):
        tensors[n].CopyFrom(numpy_helper.from_array((a / s.reshape(a.shape)).astype(a.dtype), n))
    return True


# Where an activation function's output is computed: its own op, or the
# nonlinearity inside the elementwise arithmetic of GELU (Erf, Tanh) and
# SiLU (Sigmoid).
_ACTIVATIONS = {"Gelu", "BiasGelu", "FastGelu", "QuickGelu", "Erf", "Tanh", "Sigmoid"}
_ELEMENTWISE = {"Mul", "Add", "Sub", "Div"}


def _activation_fed_matmuls(proto):
    """Names of the `MatMul`s with a constant weight whose input is an
    activation function's output: an activation op, or elementwise
    arithmetic (`x * 0.5 * (1 + erf(x / sqrt 2))`, `x * sigmoid(x)`) with
    one within three steps (a gated feed-forward block multiplies GELU's
    `x * 0.5 * (1 + erf(...))` by the up projection)."""
    weights = {t.name for t in proto.graph.initializer}
    producers = {name: node for node in proto.graph.node for name in node.output}

    def activation(value, depth):
        node = producers.get(value)
        if node is None:
            return False
        if node.op_type in _ACTIVATIONS:
            return True
        return (depth > 0 and node.op_type in _ELEMENTWISE
                and any(activation(x, depth - 1) for x in node.input))

    return {node.name for node in proto.graph.node
            if node.op_type == "MatMul" and node.input[1] in weights and activation(node.input[0], 3)}


def _first_token_apart(proto, skip=()):
    """`proto` changed in place so that each `MatMul` with a constant weight
    runs as two on the same weight, row 0 of the second-to-last axis and the
    rows after it, concatenated back (the integer rewrite then gives each
    its own activation scale and stores the weight once). An input of one
    token leaves the second MatMul empty, which onnxruntime runs. The
    MatMuls named in `skip` are left as they are."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    weights = {t.name for t in graph.initializer}
    used = weights | {v.name for v in graph.input}
    used |= {name for node in graph.node for name in list(node.input) + list(node.output)}

    def fresh(hint):
        name, index = hint, 0
        while name in used:
            index += 1
            name = f"{hint}_{index}"
        used.add(name)
        return name

    bounds = {}
    for hint, value in (("first_token_start", 0), ("first_token_end", 1),
                        ("first_token_rest_end", np.iinfo(np.int64).max), ("token_axis", -2)):
        bounds[hint] = fresh(hint)
        graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), bounds[hint]))
    start, first_end, rest_end, axis = bounds.values()
    nodes = []
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in weights or node.name in skip:
            nodes.append(node)
            continue
        x, w = node.input
        base = node.name or node.output[0]
        head, tail = fresh(f"{base}_first_token"), fresh(f"{base}_other_tokens")
        head_out, tail_out = fresh(f"{base}_first_token_out"), fresh(f"{base}_other_tokens_out")
        nodes += [
            helper.make_node("Slice", [x, start, first_end, axis], [head], name=fresh(f"{base}_slice_first")),
            helper.make_node("Slice", [x, first_end, rest_end, axis], [tail], name=fresh(f"{base}_slice_rest")),
            helper.make_node("MatMul", [head, w], [head_out], name=fresh(f"{base}_first")),
            helper.make_node("MatMul", [tail, w], [tail_out], name=fresh(f"{base}_rest")),
            helper.make_node("Concat", [head_out, tail_out], list(node.output), name=fresh(f"{base}_concat"),
                             axis=-2),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    return proto


# The ops whose int8 weight (input 1) meets uint8 activations in
# onnxruntime's integer GEMM.
_INTEGER_MATMULS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def int8_weight_extremes(proto):
    """`{node name: largest |weight|}` for the int8 weights of the integer
    matmuls in `proto` (uint8 weights, which onnxruntime multiplies without
    saturation, are left out)."""
    from onnx import TensorProto, numpy_helper

    weights = {t.name: t for t in proto.graph.initializer}
    extremes = {}
    for node in proto.graph.node:
        if node.op_type not in _INTEGER_MATMULS or len(node.input) < 2:
            continue
        tensor = weights.get(node.input[1])
        if tensor is not None and tensor.data_type == TensorProto.INT8:
            values = numpy_helper.to_array(tensor).astype(np.int32)
            extremes[node.name or node.output[0]] = int(np.abs(values).max(initial=0))
    return extremes


def check_no_int8_saturation(proto):
    """Raises `ValueError` if an int8 weight of `proto` can saturate
    onnxruntime's int16 pair sums on x86 CPUs without VNNI (|w| > 64)."""
    unsafe = {name: value for name, value in int8_weight_extremes(proto).items()
              if value > SAFE_INT8_WEIGHT}
    if unsafe:
        raise ValueError(
            f"int8 weights beyond +-{SAFE_INT8_WEIGHT} meet uint8 activations in "
            f"{sorted(unsafe)[:5]} (largest |w|: {max(unsafe.values())}): on x86 CPUs without "
            "VNNI their products saturate int16 sums and the answers change with the CPU. "
            "Quantize with reduce_range (`keras_attn.export.onnx_quantize.quantize_matmul_weights`).")


def _blockwise_symmetric(weight, bits, block_size):
    """`nbits_weight` of a `(K, N)` float32 chunk, its scales `(N, blocks)`:
    max |w| / (2^(bits-1) - 1) of each block (K zero-padded to whole blocks)."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    # Worked on in the weight's own (K, N) layout, which reduces and divides
    # along contiguous rows; only the uint8 codes are transposed at the end.
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = weight
    padded = padded.reshape(blocks, block_size, n)
    top = (1 << (bits - 1)) - 1
    scales = np.maximum(padded.max(1), -padded.min(1)) / np.float32(top)
    np.divide(padded, np.where(scales == 0, np.float32(1), scales)[:, None, :], out=padded)
    np.rint(padded, out=padded)
    np.clip(padded, -top, top, out=padded)
    padded += np.float32(1 << (bits - 1))
    codes = padded.astype(np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.transpose(2, 0, 1), scales.T


def nbits_weight(weight, bits, block_size):
    """`(stored, scales)`: a float32 `(K, N)` weight as `MatMulNBits` reads it,
    symmetric `bits`-bit codes (4 or 8) in blocks of `block_size` along K
    with the default zero point 2^(bits-1): `stored` uint8 `(N, blocks,
    block_size * bits / 8)` (two 4-bit codes a byte, the first in the low
    nibble), `scales` float32 `(N * blocks,)`."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    stored = np.empty((n, blocks, block_size * bits // 8), np.uint8)
    scales = np.empty((n, blocks), np.float32)
    # Column chunks of a few million numbers: the float temporaries of a
    # vocabulary-sized head stay small beside the model, and NumPy, which
    # lets go of the GIL in its loops, quantizes one chunk per core.
    columns = max(1, min(-(-n // _THREADS), _NUMBERS_PER_CHUNK // max(k, 1)))

    def quantize(start):
        chunk = np.asarray(weight[:, start:start + columns], np.float32)
        stored[start:start + columns], scales[start:start + columns] = _blockwise_symmetric(
            chunk, bits, block_size)

    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        list(pool.map(quantize, range(0, n, columns)))
    return stored, scales.reshape(-1)


_NUMBERS_PER_CHUNK = 1 << 22
_THREADS = min(8, os.cpu_count() or 1)


def matmul_nbits(proto, *, bits=8, block_size=32, accuracy_level=4):
    """Every `MatMul` of `proto` with a constant 2-D float32 weight as a
    `com.microsoft` `MatMulNBits` (symmetric codes, the default zero point
    2^(bits-1)). Returns `proto`, changed in place."""
    from onnx import helper, numpy_helper

    if bits not in (4, 8):
        raise ValueError(f"Received an invalid value for argument `bits`, expected 4 or 8. Received: bits={bits!r}")
    graph = proto.graph
    weights = {t.name: t for t in graph.initializer}
    targets = set(_weighted_matmuls(proto))
    nodes = []
    packed = {}  # weight name -> (codes, scales) names: a weight read twice is stored once
    for i, node in enumerate(graph.node):
        if i not in targets:
            nodes.append(node)
            continue
        tensor = weights[node.input[1]]
        k, n = tensor.dims
        if tensor.name not in packed:
            stored, scales = nbits_weight(numpy_helper.to_array(tensor), bits, block_size)
            codes = numpy_helper.from_array(stored, f"{tensor.name}_q{bits}")
            scale = numpy_helper.from_array(scales, f"{tensor.name}_scales")
            graph.initializer.extend([codes, scale])
            packed[tensor.name] = (codes.name, scale.name)
        nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0], *packed[tensor.name]], list(node.output),
            name=f"{node.name}_q{bits}", domain="com.microsoft", K=k, N=n, bits=bits,
            block_size=block_size, accuracy_level=accuracy_level))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return proto
