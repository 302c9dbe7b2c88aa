"""A TFLite flatbuffer written op by op, its constants streamed after it.

What the direct TFLite writers (`tflite_decoder`, `tflite_signatures`,
`tflite_encoder`) share: `Writer` holds the model's buffers and operator
codes and streams every constant larger than `INLINE_MAX_BYTES` to a data
file as it is made; `Graph` builds one subgraph and the layers every writer
writes (fully connected layers with their weights quantized as they are
written, activations, int8 table lookups); `write_model(path, build)` packs
the flatbuffer with each constant addressed by offset after it
(`Buffer.offset/size`, the converter's `_experimental_use_buffer_offset`
layout: no 2 GB limit, one weight in memory at a time).
"""

import hashlib
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np

# Offsets of the constants after the flatbuffer are multiples of this
# (XNNPACK and mmap like aligned weights).
ALIGNMENT = 64
# Constants up to this many bytes stay inside the flatbuffer.
INLINE_MAX_BYTES = 64
# A large weight is streamed and quantized this many numbers at a time: the
# temporaries stay small beside the weight.
SLAB_NUMBERS = 1 << 21


class Writer:
    """The model's buffers (shared by every signature), its operator codes,
    and the data file the constants stream to."""

    def __init__(self, data_file, schema):
        self.s = schema
        self.data_file = data_file
        self.buffers = [schema.BufferT()]  # buffer 0: the empty sentinel
        self.locations = {}  # buffer index -> (offset in the data file, size)
        self.small = {}  # content digest -> buffer index
        self.keyed = {}  # weight key -> (buffer index, dtype, shape, quantization)
        self.opcodes = {}
        self.location_buffer = self.buffer(np.frombuffer(b"outside flatbuffers", np.uint8))
        # Model metadata beyond `buffer_location`: (name, buffer field).
        self.metadata = []

    def buffer(self, array, inline=True):
        """The buffer of `array`: NumPy, or `ScaledColumns`; with
        `inline=False` after the flatbuffer whatever its size."""
        if inline and array.nbytes <= INLINE_MAX_BYTES:
            raw = np.asarray(array[...]).tobytes()
            digest = hashlib.sha1(raw).hexdigest()
            if digest not in self.small:
                buffer = self.s.BufferT()
                buffer.data = np.frombuffer(raw, np.uint8) if raw else None
                self.buffers.append(buffer)
                self.small[digest] = len(self.buffers) - 1
            return self.small[digest]
        offset = -(-self.data_file.tell() // ALIGNMENT) * ALIGNMENT
        self.data_file.seek(offset)
        # A slab of rows at a time: a view (a transposed kernel) is never
        # copied whole.
        step = max(1, 4 * SLAB_NUMBERS // max(1, array[0].nbytes))
        for start in range(0, len(array), step):
            self.data_file.write(memoryview(np.ascontiguousarray(array[start:start + step])).cast("B"))
        self.buffers.append(self.s.BufferT())
        self.locations[len(self.buffers) - 1] = (offset, array.nbytes)
        return len(self.buffers) - 1

    def opcode(self, name, version):
        if name not in self.opcodes:
            code = getattr(self.s.BuiltinOperator, name)
            self.opcodes[name] = (len(self.opcodes), code, version)
        return self.opcodes[name][0]

    def model(self, subgraphs, signatures, base, description):
        s = self.s
        for index, (offset, size) in self.locations.items():
            self.buffers[index].offset = base + offset
            self.buffers[index].size = size
        model = s.ModelT()
        model.version = 3
        model.description = description
        codes = []
        for _, code, version in sorted(self.opcodes.values()):
            opcode = s.OperatorCodeT()
            opcode.builtinCode = code
            opcode.deprecatedBuiltinCode = min(code, 127)
            opcode.version = version
            codes.append(opcode)
        model.operatorCodes = codes
        model.subgraphs = subgraphs
        model.signatureDefs = signatures
        model.buffers = self.buffers
        model.metadata = []
        # "buffer_location": as the converter marks a model whose buffers follow the flatbuffer.
        for name, field in [("buffer_location", self.location_buffer)] + self.metadata:
            entry = s.MetadataT()
            entry.name = name
            entry.buffer = field
            model.metadata.append(entry)
        return model

    def write(self, path, subgraphs, signatures, description):
        """Writes the flatbuffer, then the streamed constants, to `path`
        (through `path.partial`); returns `(flatbuffer bytes, constant bytes)`."""
        import flatbuffers

        data_size = self.data_file.tell()
        self.data_file.flush()

        def pack(base):
            fb = flatbuffers.Builder(1024)
            fb.Finish(self.model(subgraphs, signatures, base, description).Pack(fb),
                      file_identifier=b"TFL3")
            return fb.Output()

        # The offsets are absolute: pack once to learn the flatbuffer's size
        # (every offset field is present whatever its value), then for real.
        size = len(pack(1 << 40))
        base = -(-size // ALIGNMENT) * ALIGNMENT
        content = pack(base)
        assert len(content) == size, (len(content), size)
        partial = path + ".partial"
        with open(partial, "wb") as out:
            out.write(content)
            out.write(b"\0" * (base - size))
            self.data_file.seek(0)
            shutil.copyfileobj(self.data_file, out, 1 << 24)
        os.replace(partial, path)
        return size, data_size


# Each binary op's options kind (`Graph.binary`).
BINARY_OPTIONS = {
    "ADD": "AddOptions", "SUB": "SubOptions", "MUL": "MulOptions", "DIV": "DivOptions",
    "FLOOR_DIV": "FloorDivOptions", "FLOOR_MOD": "FloorModOptions", "MINIMUM": "MaximumMinimumOptions",
    "MAXIMUM": "MaximumMinimumOptions", "SQUARED_DIFFERENCE": "SquaredDifferenceOptions",
    "EQUAL": "EqualOptions", "NOT_EQUAL": "NotEqualOptions", "LESS": "LessOptions",
    "LESS_EQUAL": "LessEqualOptions", "GREATER": "GreaterOptions", "GREATER_EQUAL": "GreaterEqualOptions",
    "LOGICAL_AND": "LogicalAndOptions"}
_BOOLEAN_RESULTS = {"EQUAL", "NOT_EQUAL", "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "LOGICAL_AND"}
INT4 = np.dtype(ml_dtypes.int4)
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int32): 2,
          np.dtype(np.bool_): 6, np.dtype(np.int8): 9, INT4: 17}
# The versions TensorFlow's converter gives these ops in the same graph.
VERSIONS = {"FULLY_CONNECTED": 5, "GATHER": 2, "TRANSPOSE": 4,
            "EMBEDDING_LOOKUP": 4}  # 4: an int4 table
HYBRID_FULLY_CONNECTED_VERSION = 12
# int4 weights: one scale per this many input features (ai-edge-quantizer's
# `dynamic_wi4b32_afp32`, LiteRT-LM's own int4 models).
BLOCK_SIZE = 32
# bfloat16's largest finite value that float16 holds (the blockwise scales
# are float16 tensors read as bfloat16).
_SCALE_MAX = 65280.0
_TFLITE_INT8, _TFLITE_FLOAT32 = 9, 0


def quantize_rows(weight):
    """int8 codes and float32 scales of `weight` `(N, K)`, one symmetric scale
    per row (output channel): `codes * scales[:, None]` approximates it."""
    codes = np.empty(weight.shape, np.int8)
    scales = np.empty(weight.shape[0], np.float32)
    # A few thousand rows at a time: float temporaries of a slab (8 MiB each),
    # not of the table.
    step = max(1, SLAB_NUMBERS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], step):
        rows = weight[start:start + step]
        scale = np.abs(rows).max(axis=1) / np.float32(127.0)
        scale = np.where(scale > 0, scale, np.float32(1.0))
        scales[start:start + step] = scale
        codes[start:start + step] = np.clip(np.rint(rows / scale[:, None]), -127, 127)
    return codes, scales


def quantize_blocks(weight):
    """int4 codes of `weight` `(N, K)` in blocks of `BLOCK_SIZE` along K:
    `(packed, scales)`, `packed` uint8 `(N, K / 2)` (element `2j` of a row
    in the low nibble of byte `j`, `2j + 1` in the high one) and `scales`
    float16 `(N, K / BLOCK_SIZE)`, one symmetric scale per block,
    `max|block| / 7` rounded to bfloat16's 8 significant bits;
    `codes * scales` (repeated over each block) approximates `weight`."""
    n, k = weight.shape
    blocks = k // BLOCK_SIZE
    packed = np.empty((n, k // 2), np.uint8)
    scales = np.empty((n, blocks), np.float16)
    step = max(1, SLAB_NUMBERS // max(1, k))
    for start in range(0, n, step):
        rows = weight[start:start + step].reshape(-1, blocks, BLOCK_SIZE)
        scale = np.minimum(np.abs(rows).max(axis=2) / np.float32(7.0), np.float32(_SCALE_MAX))
        scale = scale.astype(ml_dtypes.bfloat16).astype(np.float16)
        scales[start:start + step] = scale
        # A block whose scale rounds to 0 (|w| < 7 * 2**-25) is all zeros.
        inverse = np.divide(np.float32(1.0), scale, out=np.zeros(scale.shape, np.float32),
                            where=scale > 0)
        codes = np.clip(np.rint(rows * inverse[..., None]), -8, 7).astype(np.int8)
        codes = codes.reshape(len(rows), k)
        packed[start:start + step] = ((codes[:, 0::2] & 0x0F) | (codes[:, 1::2] << 4)).view(np.uint8)
    return packed, scales


def quantize(weight, quantization):
    """`(array, quantization)` of a weight `(N, K)` as `Graph.weight` stores
    it: `quantization` None keeps it float32; "dynamic" is int8 per output
    channel; "int4" is int4 in blocks of `BLOCK_SIZE` along K, or int8 per
    output channel where K is not a multiple of it."""
    if quantization == "int4" and weight.shape[1] % BLOCK_SIZE == 0:
        packed, scales = quantize_blocks(weight)
        return packed, Blocks(scales)
    if quantization is not None:
        return quantize_rows(weight)
    return weight, None


class ScaledColumns:
    """`weight * scale` of a weight view `(N, K)` and a scale `(K,)` (a norm's
    scale folded into the layer after it), computed a slab of rows at a time
    as `Writer.buffer` and `quantize` read it: never a whole folded copy."""

    def __init__(self, weight, scale):
        self.weight, self.scale = weight, scale
        self.shape, self.dtype, self.nbytes = weight.shape, np.dtype(np.float32), weight.nbytes

    def __len__(self):
        return len(self.weight)

    def __getitem__(self, rows):
        return self.weight[rows] * self.scale


class Blocks:
    """The quantization of an int4 weight `(N, K)` (its codes packed two per
    byte, `(N, K / 2)` uint8): its float16 scales `(N, K / block size)`."""

    def __init__(self, scales):
        self.scales = scales


class Graph:
    """One subgraph (signature) under construction: tensors with their
    static shapes (None for the dynamic read length) and operators."""

    def __init__(self, writer, name):
        self.w = writer
        self.s = writer.s
        self.name = name
        self.tensors = []
        self.operators = []
        self.consts = {}  # (buffer, shape, dtype) or (buffer, weight key) -> tensor
        self.shapes = {}  # tensor index -> (static shape, NumPy dtype)
        self.derived = {}  # key -> a tensor (or tensors) `cached` made once in this subgraph

    def tensor(self, name, shape, dtype, buffer=0, quantization=None):
        s = self.s
        t = s.TensorT()
        t.name = name
        t.shape = np.array([1 if d is None else d for d in shape], np.int32)
        if None in shape:
            t.shapeSignature = np.array([-1 if d is None else d for d in shape], np.int32)
        t.type = DTYPES[np.dtype(dtype)]
        t.buffer = buffer
        t.quantization = quantization
        t.hasRank = True
        self.tensors.append(t)
        index = len(self.tensors) - 1
        self.shapes[index] = (tuple(shape), np.dtype(dtype))
        return index

    def shape(self, x):
        return self.shapes[x][0]

    def dtype(self, x):
        return self.shapes[x][1]

    def const(self, array, name=None):
        array = np.asarray(array)
        buffer = self.w.buffer(array)
        key = (buffer, array.shape, array.dtype.str)
        if key not in self.consts:
            self.consts[key] = self.tensor(name or f"const_{buffer}", array.shape, array.dtype, buffer)
        return self.consts[key]

    def weight(self, key, make, name):
        """A constant computed by `make()` only the first time `key` is
        asked for in the whole model (every signature reads one buffer);
        `make` returns `(array, quantization or None)`: per-row scales
        (int8), or `Blocks` (int4 codes packed two per byte)."""
        if key not in self.w.keyed:
            array, quantization = make()
            dtype, shape = array.dtype, array.shape
            if isinstance(quantization, Blocks):
                dtype, shape = INT4, (shape[0], 2 * shape[1])
                quantization = (self.w.buffer(quantization.scales), quantization.scales.shape)
            self.w.keyed[key] = (self.w.buffer(array), dtype, shape, quantization)
            del array
        buffer, dtype, shape, quantization = self.w.keyed[key]
        if (buffer, key) not in self.consts:
            q = None
            if dtype == INT4:
                # ai-edge-quantizer's blockwise layout: a float16 scales
                # tensor named by the details, no zero points.
                scales_buffer, scales_shape = quantization
                q = self.s.QuantizationParametersT()
                q.detailsType = self.s.QuantizationDetails.BlockwiseQuantization
                q.details = self.s.BlockwiseQuantizationT()
                q.details.scales = self.tensor(name + "_scales", scales_shape, np.float16,
                                               scales_buffer)
                q.details.zeroPoints = -1
                q.details.blockSize = shape[1] // scales_shape[1]
            elif quantization is not None:
                q = self.s.QuantizationParametersT()
                q.scale = quantization
                q.zeroPoint = np.zeros(len(quantization), np.int64)
                q.quantizedDimension = 0
            self.consts[(buffer, key)] = self.tensor(name, shape, dtype, buffer, q)
        return self.consts[(buffer, key)]

    def cached(self, key, make):
        """`make()`'s tensors, made the first time `key` is asked for in this subgraph."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def op(self, name, inputs, shape, dtype=np.float32, options=None, outputs=1, version=None,
           out_name=None, **fields):
        """Appends operator `name`; returns its output tensor (a list for
        `outputs > 1`, each of `shape`, or of the shapes in a list `shape`).
        `options` is an options object, or its kind ("SliceOptions") with
        `fields`."""
        if isinstance(options, str):
            options = self.options(options, **fields)
        shapes = shape if outputs > 1 and isinstance(shape, list) else [shape] * outputs
        label = out_name or f"{self.name}/{name.lower()}_{len(self.operators)}"
        outs = [self.tensor(label if outputs == 1 else f"{label}:{k}", shp, dtype)
                for k, shp in enumerate(shapes)]
        operator = self.s.OperatorT()
        operator.opcodeIndex = self.w.opcode(name, version or VERSIONS.get(name, 1))
        operator.inputs = np.array(inputs, np.int32)
        operator.outputs = np.array(outs, np.int32)
        if options is not None:
            operator.builtinOptionsType = getattr(self.s.BuiltinOptions, type(options).__name__[:-1])
            operator.builtinOptions = options
        self.operators.append(operator)
        return outs[0] if outputs == 1 else outs

    def options(self, kind, **fields):
        options = getattr(self.s, kind + "T")()
        for key, value in fields.items():
            setattr(options, key, value)
        return options

    # Elementwise helpers (shapes broadcast as NumPy's).
    def binary(self, name, a, b):
        """`a name b`: a comparison's or LOGICAL_AND's result is bool."""
        dtype = np.bool_ if name in _BOOLEAN_RESULTS else self.dtype(a)
        return self.op(name, [a, b], broadcast(self.shape(a), self.shape(b)), dtype, BINARY_OPTIONS[name])

    def add(self, a, b):
        return self.binary("ADD", a, b)

    def mul(self, a, b):
        return self.binary("MUL", a, b)

    def reshape(self, x, shape):
        shape = tuple(shape)
        static = tuple(None if d == -1 else d for d in shape)
        if -1 in shape and None not in self.shape(x):
            known = int(np.prod([d for d in shape if d != -1]))
            static = tuple(int(np.prod(self.shape(x))) // known if d == -1 else d for d in shape)
        return self.op("RESHAPE", [x, self.const(np.array(shape, np.int32))], static, self.dtype(x))

    def transpose(self, x, perm):
        shape = tuple(self.shape(x)[p] for p in perm)
        return self.op("TRANSPOSE", [x, self.const(np.array(perm, np.int32))], shape, self.dtype(x),
                       self.options("TransposeOptions"))

    def concat(self, xs, axis):
        shapes = [self.shape(x) for x in xs]
        out = list(shapes[0])
        out[axis] = (None if any(s[axis] is None for s in shapes)
                     else sum(s[axis] for s in shapes))
        return self.op("CONCATENATION", xs, tuple(out), self.dtype(xs[0]),
                       self.options("ConcatenationOptions", axis=axis))

    def slice(self, x, begin, size, shape):
        """`x[begin:begin + size]` of static `shape`; `begin`, `size`: lists of
        ints (constants) or int32 tensors."""
        begin, size = (self.const(np.array(v, np.int32)) if isinstance(v, list) else v for v in (begin, size))
        return self.op("SLICE", [x, begin, size], shape, self.dtype(x), self.options("SliceOptions"))

    def split(self, x, sizes):
        """`x` split along its last axis into parts of `sizes` (SPLIT_V)."""
        shape = self.shape(x)
        return self.op("SPLIT_V", [x, self.const(np.array(sizes, np.int32)), self.const(np.array(-1, np.int32))],
                       [shape[:-1] + (n,) for n in sizes], self.dtype(x),
                       self.options("SplitVOptions", numSplits=len(sizes)), outputs=len(sizes))

    def dims(self, x, start=0, count=None):
        """`x`'s dynamic shape (SHAPE, int32), or `count` of its axes from `start`."""
        shape = self.op("SHAPE", [x], (len(self.shape(x)),), np.int32, "ShapeOptions", outType=2)
        return shape if count is None else self.slice(shape, [start], [count], (count,))

    def gather(self, table, ids, axis=0):
        t, i = self.shape(table), self.shape(ids)
        axis = axis % len(t)
        return self.op("GATHER", [table, ids], t[:axis] + i + t[axis + 1:], self.dtype(table),
                       self.options("GatherOptions", axis=axis, batchDims=0))

    # Layers every writer writes.
    def fc_weight(self, key, make_kernel, name, quantization, scale=None):
        """A FULLY_CONNECTED weight `(N, K)` stored once per `key` (`weight`):
        `make_kernel()` `(K, N)` (Keras's layout) transposed as a view, each
        input feature's weights times `scale` `(K,)` where given
        (`ScaledColumns`), quantized (`quantize`) or streamed as it is:
        never copied whole."""
        def make():
            weight = make_kernel().T
            return quantize(weight if scale is None else ScaledColumns(weight, scale), quantization)

        return self.weight(key, make, name)

    def fully_connected(self, x, weight, bias, name, out_name=None):
        """`x (T, K) @ weight.T + bias` -> `(T, N)`, `weight` a `fc_weight`
        tensor, `bias` NumPy (a constant `name/bias`) or None. An int8
        weight runs LiteRT's hybrid kernels on asymmetrically quantized
        inputs; an int4 one as ai-edge-quantizer writes it (the blockwise
        kernels quantize inputs asymmetrically whatever the flag)."""
        inputs = [x, weight, -1 if bias is None else self.const(bias, name + "/bias")]
        options = self.options("FullyConnectedOptions", keepNumDims=False,
                               asymmetricQuantizeInputs=self.dtype(weight) == np.int8)
        version = None if self.dtype(weight) == np.float32 else HYBRID_FULLY_CONNECTED_VERSION
        return self.op("FULLY_CONNECTED", inputs, (self.shape(x)[0], self.shape(weight)[0]), np.float32,
                       options, version=version, out_name=out_name)

    def gather_int8(self, codes, scales, ids, name):
        """Rows at `ids` of an int8 table `codes` with per-row `scales`: the
        int8 rows, cast, times their gathered scales (`name/scales`; a
        GATHER does not dequantize per row)."""
        rows = self.gather(codes, ids)
        rows = self.op("CAST", [rows], self.shape(rows), np.float32, "CastOptions",
                       inDataType=_TFLITE_INT8, outDataType=_TFLITE_FLOAT32)
        return self.mul(rows, self.gather(self.const(scales.reshape(-1, 1), name + "/scales"), ids))

    def activation(self, x, kind):
        """`kind` (a canonical activation name) over `x`, as the converter writes it."""
        if kind == "linear":
            return x
        if kind == "silu":
            return self.mul(x, self.op("LOGISTIC", [x], self.shape(x)))
        if kind.startswith("gelu"):
            return self.op("GELU", [x], self.shape(x), np.float32, "GeluOptions",
                           approximate=kind == "gelu_tanh")
        return self.op(kind.upper(), [x], self.shape(x))  # RELU, TANH

    def finish(self, inputs, outputs, tensor_name="{graph}_{key}", subgraph_name=None, sort=False):
        """The subgraph and its signature (named as this graph): `inputs` and
        `outputs` are `[(signature name, tensor)]` in the subgraph's order,
        listed by the signature in that order or, with `sort`, by name; the
        output tensors are named `tensor_name` (`graph`, `key`, `k`: the
        graph's name, the output's, its place)."""
        s = self.s
        for k, (key, index) in enumerate(outputs):
            self.tensors[index].name = tensor_name.format(graph=self.name, key=key, k=k)
        subgraph = s.SubGraphT()
        subgraph.name = subgraph_name or self.name
        subgraph.tensors = self.tensors
        subgraph.operators = self.operators
        subgraph.inputs = np.array([index for _, index in inputs], np.int32)
        subgraph.outputs = np.array([index for _, index in outputs], np.int32)
        signature = s.SignatureDefT()
        signature.signatureKey = self.name
        order = sorted if sort else list
        signature.inputs = [self._tensor_map(key, index) for key, index in order(inputs)]
        signature.outputs = [self._tensor_map(key, index) for key, index in order(outputs)]
        return subgraph, signature

    def _tensor_map(self, name, index):
        m = self.s.TensorMapT()
        m.name = name
        m.tensorIndex = index
        return m


def broadcast(a, b):
    """NumPy's broadcast of two static shapes (None: a dynamic axis)."""
    rank = max(len(a), len(b))
    a, b = ((1,) * (rank - len(shape)) + tuple(shape) for shape in (a, b))
    return tuple(max(x, y) if None not in (x, y) else y if x == 1 else x if y == 1 else None
                 for x, y in zip(a, b))


def write_model(path, build, description="keras_attn direct TFLite writer"):
    """Writes the TFLite model `build(writer)` makes to `path`.

    `build` takes a `Writer` (its data file in a temporary folder beside
    `path`) and returns `[(subgraph, signature), ...]` in subgraph order.
    `description` is the model's description field.

    Returns:
        `{"buffers": n, "weight_bytes": bytes after the flatbuffer,
        "flatbuffer_bytes": n}`.
    """
    from tensorflow.lite.python import schema_py_generated as schema

    path = os.fspath(path)
    with tempfile.TemporaryDirectory(
            prefix="keras_attn_tflite_", dir=os.path.dirname(os.path.abspath(path))) as tmp:
        with open(os.path.join(tmp, "weights.bin"), "w+b") as data_file:
            writer = Writer(data_file, schema)
            subgraphs, signatures = [], []
            for index, (subgraph, signature) in enumerate(build(writer)):
                signature.subgraphIndex = index
                subgraphs.append(subgraph)
                signatures.append(signature)
            size, data_size = writer.write(path, subgraphs, signatures, description)
    return {"buffers": len(writer.buffers), "weight_bytes": data_size, "flatbuffer_bytes": size}
