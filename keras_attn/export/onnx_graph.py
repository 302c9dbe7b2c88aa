"""The ONNX graph builder of the direct writers (`onnx_fused`'s encoders,
`onnx_decoder`'s GenAI graph, `onnx_signatures`' prefill/decode) and the
check of their external weights.

`Graph` builds a ModelProto in place (no lists copied into a graph, then
into a model). Given a `weights_file`, each initializer is written there as
it is made, so an export holds one tensor at a time and no message holds
them all (protobuf's 2 GB limit). That file is one of:
- the model file itself (`external=False`: one self-contained `.onnx`),
  each tensor as a ModelProto holding only it: concatenated serialized
  messages parse as one, repeated fields appended, so the pieces followed by
  the finished proto's serialization are the model;
- ONNX external data beside the model (`external=True`): each tensor of at
  least 1 KiB written from the array's memory at a 4 KiB-aligned offset
  that onnxruntime memory-maps. The arrays that are the model's own memory
  (`borrowed`) are collected in `shared`: `inference_session` runs on them
  instead of a second copy, once `check_external_data` has found the file's
  bytes equal to them.
"""

import os

import numpy as np

from keras_attn.export.capabilities import NotFusableError

MS_DOMAIN = "com.microsoft"


# Tensors at least this large go to an external data file, each at an
# offset onnxruntime can memory-map.
_EXTERNAL_MIN_BYTES = 1024
_EXTERNAL_ALIGNMENT = 4096
_COMPARE_BYTES = 1 << 26
# onnxruntime's contrib op of each GELU.
_MS_GELUS = {"gelu": "Gelu", "gelu_tanh": "FastGelu"}


class Graph:
    """An ONNX model being written: `proto` (its `graph`), `node`, `const`,
    and the pieces both decoder writers build alike (`activation`,
    `soft_cap`, `feedforward`); `finish` adds the inputs, outputs and opsets."""

    def __init__(self, weights_file=None, *, external=False, shared=None):
        import onnx

        self.proto = onnx.ModelProto()
        self.graph = self.proto.graph
        self.weights_file = weights_file  # open binary file, or None: weights inside the proto
        self.external = external
        # {name: array} of the external weights that are the model's own
        # memory (`borrowed`), when a dict is given.
        self.shared = shared
        self._made = {}

    def const(self, array, name):
        """The initializer `name` holding `array` (its shape as given: a scalar stays one)."""
        import onnx

        array = np.asarray(array)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        header = {"name": name, "dims": array.shape,
                  "data_type": onnx.helper.np_dtype_to_tensor_dtype(array.dtype)}
        f = self.weights_file
        if f is not None and self.external and array.nbytes >= _EXTERNAL_MIN_BYTES:
            offset = -(-f.tell() // _EXTERNAL_ALIGNMENT) * _EXTERNAL_ALIGNMENT
            f.seek(offset)
            f.write(array.reshape(-1).view(np.uint8).data)  # no bytes copy
            tensor = self.graph.initializer.add(data_location=onnx.TensorProto.EXTERNAL, **header)
            for key, value in (("location", os.path.basename(f.name)), ("offset", str(offset)),
                               ("length", str(array.nbytes))):
                tensor.external_data.add(key=key, value=value)
            if self.shared is not None and borrowed(array):
                self.shared[name] = array
        elif f is not None and not self.external:
            piece = onnx.ModelProto()  # no tensor outlives its own write
            piece.graph.initializer.add(raw_data=array.tobytes(), **header)
            f.write(piece.SerializeToString())
        else:
            self.graph.initializer.add(raw_data=array.tobytes(), **header)
        return name

    def node(self, op, inputs, name, outputs=1, domain="", **attrs):
        """A node named `name`; `outputs`: how many (named `name/output_i`)
        or their names. Returns the output name, or the list of them."""
        from onnx import helper

        names = [f"{name}/output_{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.graph.node.append(helper.make_node(op, inputs, names, name=name, domain=domain, **attrs))
        return names[0] if len(names) == 1 else names

    def once(self, key, make):
        """`make()`, called the first time `key` is asked for (a value the graph derives once)."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def activation(self, x, name, kind, standard=False):
        """`kind` (an `activation_name`) of `x`; GELU as onnxruntime's `Gelu` /
        `FastGelu`, or, `standard`, in standard ops (opset 17 has no GELU)."""
        if kind == "linear":
            return x
        if kind == "silu":
            return self.node("Mul", [x, self.node("Sigmoid", [x], name + "/Sigmoid")], name + "/Mul")
        if kind in ("relu", "tanh"):
            return self.node(kind.capitalize(), [x], f"{name}/{kind.capitalize()}")
        if kind in _MS_GELUS and standard:
            return self._standard_gelu(x, name, kind)
        if kind in _MS_GELUS:
            return self.node(_MS_GELUS[kind], [x], f"{name}/{_MS_GELUS[kind]}", domain=MS_DOMAIN)
        raise NotFusableError(f"activation {kind!r} of {name}")

    def soft_cap(self, x, cap, names):
        """`cap * tanh(x / cap)`, `cap` a constant's name; `names`: the Div, Tanh and Mul nodes'."""
        x = self.node("Tanh", [self.node("Div", [x, cap], names[0])], names[1])
        return self.node("Mul", [x, cap], names[2])

    def feedforward(self, h, feedforward, dense, name, standard=False):
        """A described `FeedForward`: `down(act(gate(h)) * up(h))` or `down(act(fc1(h)))`, each
        projection written by `dense(h, part, described)`; `name("act")`, `name("Mul")`: node names."""
        if feedforward.gate is not None:
            gate = dense(h, "gate", feedforward.gate)
            up = dense(h, "up", feedforward.up)
            h = self.node("Mul", [self.activation(gate, name("act"), feedforward.activation, standard), up],
                          name("Mul"))
        else:
            h = self.activation(dense(h, "fc1", feedforward.up), name("act"), feedforward.activation, standard)
        return dense(h, "down", feedforward.down)

    def rms_norm(self, x, scale, epsilon, opset, name):
        """`x * rsqrt(mean(x^2) + epsilon) * scale` over the last axis, as
        `keras.ops.rms_normalization`, in standard ops of `opset`; `scale` a
        value's name, `name(hint)` a fresh node or constant name."""
        # Pow and Div rather than Mul(x, x) and a Reciprocal: the form
        # onnxruntime fuses into one SimplifiedLayerNormalization at load.
        square = self.node("Pow", [x, self.const(np.float32(2), name("two"))], name("square"))
        if opset >= 18:  # `axes` is an input from opset 18
            axes = self.const(np.array([-1], np.int64), name("axes"))
            mean = self.node("ReduceMean", [square, axes], name("ReduceMean"), keepdims=1)
        else:
            mean = self.node("ReduceMean", [square], name("ReduceMean"), axes=[-1], keepdims=1)
        mean = self.node("Add", [mean, self.const(np.array(epsilon, np.float32), name("eps"))], name("eps"))
        x = self.node("Div", [x, self.node("Sqrt", [mean], name("sqrt"))], name("normalized"))
        return self.node("Mul", [x, scale], name("scaled"))

    def rotate_half(self, x, cos, sin, head_dim, rotary_dim, name):
        """keras_attn's `RotaryEmbedding` ("rotate half") of `x` `(..., head_dim)`
        over its first `rotary_dim` features; `cos`, `sin` broadcast against
        `(..., rotary_dim / 2)`; `name(hint)` a fresh node or constant name."""
        half = rotary_dim // 2
        sizes = [half, half] + ([head_dim - 2 * half] if 2 * half < head_dim else [])
        parts = self.node("Split", [x, self.const(np.array(sizes, np.int64), name("sizes"))],
                          name("rotary_split"), outputs=len(sizes), axis=-1)
        x1, x2 = parts[0], parts[1]
        first = self.node("Sub", [self.node("Mul", [x1, cos], name("x1cos")),
                                  self.node("Mul", [x2, sin], name("x2sin"))], name("rot1"))
        second = self.node("Add", [self.node("Mul", [x2, cos], name("x2cos")),
                                   self.node("Mul", [x1, sin], name("x1sin"))], name("rot2"))
        return self.node("Concat", [first, second] + list(parts[2:]), name("rotated"), axis=-1)

    def _standard_gelu(self, x, name, kind):
        """`0.5 x (1 + erf(x / sqrt 2))`, or with `tanh(sqrt(2 / pi) (x + 0.044715 x^3))`
        (`keras_attn.activations.gelu_tanh`), in standard ops, in the forms
        onnxruntime fuses into one `Gelu` / `FastGelu` at load (a Div by
        sqrt 2, not a Mul by its inverse; `Pow(x, 3)`, not `x * x * x`)."""
        if kind == "gelu":
            inner = self.node("Div", [x, self.const(np.float32(np.sqrt(2)), name + "/sqrt2")], name + "/Div_sqrt2")
            curve = self.node("Erf", [inner], name + "/Erf")
        else:
            cube = self.node("Pow", [x, self.const(np.float32(3), name + "/three")], name + "/Pow_cube")
            cube = self.node("Mul", [cube, self.const(np.float32(0.044715), name + "/c")], name + "/Mul_c")
            inner = self.node("Mul", [self.node("Add", [x, cube], name + "/Add_cube"),
                                      self.const(np.float32(np.sqrt(2 / np.pi)), name + "/k")],
                              name + "/Mul_k")
            curve = self.node("Tanh", [inner], name + "/Tanh")
        curve = self.node("Add", [curve, self.const(np.float32(1.0), name + "/one")], name + "/Add_one")
        half = self.node("Mul", [x, self.const(np.float32(0.5), name + "/half")], name + "/Mul_half")
        return self.node("Mul", [half, curve], name + "/Mul")

    def finish(self, name, inputs, outputs, opsets, ir_version):
        """`proto` with the graph's name, inputs and outputs (value infos) and
        `opsets` (`(domain, version)` pairs), written by keras_attn."""
        from onnx import helper

        self.graph.name = name
        self.graph.input.extend(inputs)
        self.graph.output.extend(outputs)
        self.proto.opset_import.extend(helper.make_opsetid(domain, version) for domain, version in opsets)
        self.proto.producer_name = "keras_attn"
        self.proto.ir_version = ir_version
        return self.proto


def borrowed(array):
    """Whether `array` views memory that no NumPy array made here owns (a
    variable's buffer, from `keras_attn.description.array_of`): keeping it costs nothing."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return not isinstance(array, np.ndarray)


def check_external_data(path, arrays, checked=None):
    """Raises `ParityError` unless each initializer of the ONNX file `path`
    named in `arrays` (`{name: array}`) is in its external data with that
    array's type, shape and bytes (read a piece at a time: nothing of the
    file stays resident). `checked`: a dict of the `(file, offset, length)`
    already compared, per name, which this call adds to; a tensor stored
    where one of them is (models sharing one weights file) is not read
    again."""
    import onnx
    from onnx import helper

    from keras_attn.export.report import ParityError

    folder = os.path.dirname(os.path.abspath(path))
    tensors = {t.name: t for t in onnx.load(path, load_external_data=False).graph.initializer}
    checked = {} if checked is None else checked
    piece = np.empty(_COMPARE_BYTES, np.uint8)
    for name, array in arrays.items():
        tensor = tensors.get(name)
        where = {e.key: e.value for e in tensor.external_data} if tensor is not None else {}
        if (tensor is None or tensor.data_location != onnx.TensorProto.EXTERNAL
                or tuple(tensor.dims) != array.shape
                or tensor.data_type != helper.np_dtype_to_tensor_dtype(array.dtype)
                or int(where.get("length", -1)) != array.nbytes):
            raise ParityError(f"{path}: initializer {name!r} is not stored as the model's "
                              f"{array.dtype} {array.shape} weight")
        span = (os.path.join(folder, where["location"]), int(where.get("offset", 0)), array.nbytes)
        if checked.get(name) == span:
            continue
        expected = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        with open(span[0], "rb") as f:
            f.seek(span[1])
            for start in range(0, expected.size, piece.size):
                count = f.readinto(piece[:min(piece.size, expected.size - start)])
                if count == 0 or not _same_bytes(piece[:count], expected[start:start + count]):
                    raise ParityError(f"{path}: the bytes of initializer {name!r} in "
                                      f"{where['location']} differ from the model's weight")
        checked[name] = span


def inference_session(path, shared=None, prepack=True):
    """An onnxruntime CPU session of the ONNX file `path` that runs on the
    arrays `shared` (`{initializer name: array}`, e.g. views of a model's
    variables) in place of those initializers' stored bytes, which the
    caller checks against them (`check_external_data`). `prepack=False`:
    no packed copies of the weights (each call packs them again)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in (shared or {}).items()}
    for name, value in values.items():
        options.add_initializer(name, value)
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    session.borrowed_values = values  # onnxruntime borrows them: they must outlive the session
    return session


def _same_bytes(a, b):
    """`a == b` for two 1-D uint8 arrays of one size, eight bytes a compare."""
    whole = a.size // 8 * 8
    return (np.array_equal(a[:whole].view(np.uint64), b[:whole].view(np.uint64))
            and np.array_equal(a[whole:], b[whole:]))
