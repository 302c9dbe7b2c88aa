"""A TFLite flatbuffer written op by op, its constants streamed after it.

What the direct TFLite writers (`tflite_decoder` for LiteRT-LM decoders,
`tflite_encoder` for Transformer encoders) share: `Writer` holds the model's
buffers and operator codes and streams every constant larger than
`INLINE_MAX_BYTES` to a data file as it is made; `Graph` builds one
subgraph (tensors with their static shapes, None for a dynamic axis, and
builtin operators); `Writer.write` packs the flatbuffer with each constant
addressed by offset after it (`Buffer.offset/size`, the converter's
`_experimental_use_buffer_offset` layout: no 2 GB limit, one weight in memory
at a time) and appends the data file; `write_model(path, build)` runs the
whole: a `Writer` whose data file lives in a temporary folder beside
`path`, the subgraphs `build(writer)` makes, the file.
"""

import hashlib
import os
import shutil
import tempfile

import numpy as np

# Offsets of the constants after the flatbuffer are multiples of this
# (XNNPACK and mmap like aligned weights).
ALIGNMENT = 64
# Constants up to this many bytes stay inside the flatbuffer.
INLINE_MAX_BYTES = 64


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

    def buffer(self, array):
        array = np.ascontiguousarray(array)
        if array.nbytes <= INLINE_MAX_BYTES:
            raw = array.tobytes()
            digest = hashlib.sha1(raw).hexdigest()
            if digest not in self.small:
                buffer = self.s.BufferT()
                buffer.data = np.frombuffer(raw, np.uint8) if raw else None
                self.buffers.append(buffer)
                self.small[digest] = len(self.buffers) - 1
            return self.small[digest]
        offset = -(-self.data_file.tell() // ALIGNMENT) * ALIGNMENT
        self.data_file.seek(offset)
        self.data_file.write(memoryview(array).cast("B"))
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
        # As the converter marks a model whose buffers follow the flatbuffer.
        metadata = s.MetadataT()
        metadata.name = "buffer_location"
        metadata.buffer = self.location_buffer
        model.metadata = [metadata]
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


DTYPES = {np.dtype(np.float32): 0, np.dtype(np.int32): 2, np.dtype(np.bool_): 6,
           np.dtype(np.int8): 9}
# The versions TensorFlow's converter gives these ops in the same graph.
VERSIONS = {"FULLY_CONNECTED": 5, "GATHER": 2, "TRANSPOSE": 4}
HYBRID_FULLY_CONNECTED_VERSION = 12


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
        self.rotary = {}  # (id(RotaryEmbedding), head_dim) -> (cos, sin) at this chunk's positions

    def tensor(self, name, shape, dtype, buffer=0, quantization=None):
        s = self.s
        t = s.TensorT()
        t.name = name
        dynamic = any(d is None for d in shape)
        t.shape = np.array([1 if d is None else d for d in shape], np.int32)
        if dynamic:
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

    def const(self, array, name=None, dtype=None):
        array = np.asarray(array, dtype)
        buffer = self.w.buffer(array)
        key = (buffer, array.shape, array.dtype.str)
        if key not in self.consts:
            self.consts[key] = self.tensor(name or f"const_{buffer}", array.shape, array.dtype, buffer)
        return self.consts[key]

    def weight(self, key, make, name):
        """A constant computed by `make()` only the first time `key` is
        asked for in the whole model (every signature reads one buffer);
        `make` returns `(array, quantization or None)`."""
        if key not in self.w.keyed:
            array, quantization = make()
            self.w.keyed[key] = (self.w.buffer(array), array.dtype, array.shape, quantization)
            del array
        buffer, dtype, shape, quantization = self.w.keyed[key]
        if (buffer, key) not in self.consts:
            q = None
            if quantization is not None:
                q = self.s.QuantizationParametersT()
                q.scale = quantization
                q.zeroPoint = np.zeros(len(quantization), np.int64)
                q.quantizedDimension = 0
            self.consts[(buffer, key)] = self.tensor(name, shape, dtype, buffer, q)
        return self.consts[(buffer, key)]

    def op(self, name, inputs, shape, dtype=np.float32, options=None, outputs=1, version=None,
           out_name=None):
        """Appends operator `name`; returns its output tensor (a list for
        `outputs > 1`, each of `shape`, or of the shapes in a list `shape`)."""
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
    def binary(self, name, a, b, dtype=None, options=None):
        shape = broadcast(self.shape(a), self.shape(b))
        return self.op(name, [a, b], shape, dtype or self.dtype(a), options)

    def add(self, a, b):
        return self.binary("ADD", a, b, options=self.options("AddOptions"))

    def mul(self, a, b):
        return self.binary("MUL", a, b, options=self.options("MulOptions"))

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

    def concat(self, xs, axis, dtype=None):
        shapes = [self.shape(x) for x in xs]
        out = list(shapes[0])
        out[axis] = (None if any(s[axis] is None for s in shapes)
                     else sum(s[axis] for s in shapes))
        return self.op("CONCATENATION", xs, tuple(out), dtype or self.dtype(xs[0]),
                       self.options("ConcatenationOptions", axis=axis))

    def gather(self, table, ids, axis=0, dtype=None):
        t, i = self.shape(table), self.shape(ids)
        axis = axis % len(t)
        shape = t[:axis] + i + t[axis + 1:]
        return self.op("GATHER", [table, ids], shape, dtype or self.dtype(table),
                       self.options("GatherOptions", axis=axis, batchDims=0))


def broadcast(a, b):
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + tuple(a)
    b = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x is None or y is None:
            out.append(y if x == 1 else x if y == 1 else None)
        else:
            out.append(max(x, y))
    return tuple(out)


def write_model(path, build, description="keras_attn direct TFLite writer"):
    """Writes the TFLite model `build(writer)` makes to `path`.

    `build` takes a `Writer` and returns `[(subgraph, signature), ...]` in
    subgraph order; every constant it makes streams to a temporary data file
    beside `path` as it is made and lands after the flatbuffer, addressed by
    offset. `description` is the model's description field.

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
