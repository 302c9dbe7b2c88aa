"""Decoder graphs with onnxruntime's fused kernels, written from the Keras weights.

The graph `onnxruntime_genai` runs for a decoder-only LM, with Hugging Face's
I/O names (see `keras_attn.runtimes.onnx_genai`), written op by op as the ONNX
Runtime GenAI model builder writes its own (onnxruntime-genai,
`src/python/py/models/builders/base.py`) instead of converting the Keras
graph with tf2onnx: per block `SkipSimplifiedLayerNormalization` (residual
add and RMSNorm in one kernel), one packed Q/K/V `MatMul` and
`com.microsoft` `GroupQueryAttention` (the layer's cos/sin caches, window as
`local_window_size`, soft cap as `softcap`; the past/present caches `(B,
H_kv, max_length, head_dim)` in one shared buffer), then the feed-forward.

A tied token table is stored once: in float32 as the table, read by the head
as a `Gemm` with `transB=1` (a `MatMul` would need its transpose, which
onnxruntime folds into a second vocabulary-sized copy when it loads the
model); quantized as the head's codes, looked up by `GatherBlockQuantized`
as the builder does for tied models.

The rotary caches are the model's own `RotaryEmbedding` evaluated at every
position, so any static `rope_scaling` (linear, llama3) is exact; dynamic
NTK scaling, which depends on the call's length, is not representable and is
refused, as is LongRoPE past its original length (its factors switch with
the call's length). Weights are float32 `MatMul`s, or `MatMulNBits` with
`bits=8` or `4` (`onnx_quantize.nbits_weight`), quantized as they are written.

LoRA adapters are merged into the kernels (the description's `kernel`), or,
with `adapters=`, kept apart as graph inputs that ONNX Runtime's adapter
files (`.onnx_adapter`) feed: each adapted projection adds `(x @ A) @ B'`
(`B'` = `(alpha / r) * B`), named and defaulted (empty, rank 0) as Olive's
`ExtractAdapters` writes them for ONNX Runtime GenAI.

A model this writer does not cover raises `NotFusableError` naming the
setting; `keras_attn.runtimes.onnx_genai.export_onnx_genai` then falls back
to the tf2onnx graph with a warning.
"""

import contextlib
import math

import numpy as np

from keras_attn import checks
from keras_attn.export import capabilities
from keras_attn.export import onnx_quantize
from keras_attn.export.onnx_graph import MS_DOMAIN
from keras_attn.export.onnx_graph import Graph

PROMPT_LOGITS = ("last", "all")


def check_fusable_decoder(model, max_length=None, adapters=False):
    """`capabilities.checked` for this writer (its LoRA adapters as graph inputs, with `adapters`)."""
    return capabilities.checked(model, "onnx_genai", max_length, adapters=adapters)


# The projections' node names under `/model/layers.{i}/`, as the GenAI model
# builder names them; the adapter inputs are named after them.
_PROJECTION_NODES = {"query": "attn/q_proj", "key": "attn/k_proj", "value": "attn/v_proj",
                     "output": "attn/o_proj", "gate": "mlp/gate_proj", "down": "mlp/down_proj"}


def _projection_node(part, feedforward):
    """The node name of the projection `part` (a `_PROJECTION_NODES` key, "up" or "fc1")."""
    if part in ("up", "fc1"):
        return "mlp/up_proj" if feedforward.gate is not None else "mlp/fc1"
    return _PROJECTION_NODES[part]


def adapter_name(node, factor):
    """The graph input of factor "A" or "B" of the adapter on the projection
    `node` (`/model/layers.0/attn/q_proj`): PEFT's parameter name as Olive's
    `ExtractAdapters` writes it, `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return node.lstrip("/").replace("/attn/", "/self_attn/").replace("/", ".") + f".lora_{factor}.weight"


def adapter_weights(description):
    """`{graph input name: array}` of every LoRA adapter of the description:
    A `(in, r)` and `scale * B` `(r, out)`, what an `.onnx_adapter` file
    holds for the graph `decoder_model_proto(..., adapters=...)` writes."""
    weights = {}
    for i, layer in enumerate(description.layers):
        a, f = layer.attention, layer.feedforward
        parts = {"query": a.query, "key": a.key, "value": a.value, "output": a.output, "gate": f.gate,
                 "up": f.up, "down": f.down}
        for part, dense in parts.items():
            if dense is not None and dense.lora is not None:
                node = f"/model/layers.{i}/{_projection_node(part, f)}"
                weights[adapter_name(node, "A")] = dense.lora.a.read()
                weights[adapter_name(node, "B")] = dense.lora.scaled_b()
    return weights


class DecoderGraph(Graph):
    """The decoder writers' `Graph` (weights large enough streamed to an
    external data file, when given) with the weight helpers (`weight`,
    `tied_table`, `apply`, `gather_rows`) they share: float32, or
    `MatMulNBits` with `bits`."""

    def __init__(self, bits, block_size, accuracy_level, data_file=None, shared=None, adapters=None):
        super().__init__(data_file, external=True, shared=shared)
        self.bits = bits
        self.block_size = block_size
        self.accuracy_level = accuracy_level
        # None: adapters merged into the kernels. A dict: each adapter's A and
        # scaled B are graph inputs (recorded here with their values).
        self.adapters = adapters
        self.adapter_inputs = []

    def kernel(self, dense):
        """The `(in, out)` kernel `dense` is written with: merged with its
        adapter, or without it when the adapters are inputs."""
        if self.adapters is not None and dense.lora is not None:
            return dense.lora.base.read()
        return dense.kernel.read()

    def _adapter_input(self, name, value, rank_axis):
        """Graph input `name` (a LoRA factor, rank axis `lora_r`), by default
        empty (rank 0: the update `x @ A @ B` is zero), as Olive's
        `ExtractAdapters` makes them; onnxruntime feeds an active
        `.onnx_adapter`'s tensor of that name instead."""
        from onnx import TensorProto
        from onnx import helper

        self.adapters[name] = value
        shape = list(value.shape)
        shape[rank_axis] = 0
        self.const(np.zeros(shape, np.float32), name)
        shape[rank_axis] = "lora_r"
        self.adapter_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def add_adapters(self, x, y, parts, name):
        """`y` (the packed product of `x` and the projections `parts`, `[(node
        name, Dense)]` side by side on the last axis) plus each adapted
        one's `x @ A @ (scale B)`, with the adapters as graph inputs; `y`
        when they are merged. The factors go in as one pair: the A's side
        by side, the B's stacked, each padded out to its own columns."""
        if self.adapters is None:
            return y
        width = sum(dense.kernel.shape[1] for _, dense in parts)
        factors_a, factors_b, offset = [], [], 0
        for node, dense in parts:
            out = dense.kernel.shape[1]
            if dense.lora is not None:
                factors_a.append(self._adapter_input(adapter_name(node, "A"), dense.lora.a.read(), 1))
                b = self._adapter_input(adapter_name(node, "B"), dense.lora.scaled_b(), 0)
                if out != width:
                    pads = self.const(np.array([0, offset, 0, width - offset - out], np.int64),
                                      node + "/lora_B/pads")
                    b = self.node("Pad", [b, pads], node + "/lora_B/Pad")
                factors_b.append(b)
            offset += out
        if not factors_a:
            return y
        if len(factors_a) > 1:
            factors_a = [self.node("Concat", factors_a, name + "/lora_A/Concat", axis=1)]
            factors_b = [self.node("Concat", factors_b, name + "/lora_B/Concat", axis=0)]
        low = self.node("MatMul", [x, factors_a[0]], name + "/lora_A/MatMul")
        update = self.node("MatMul", [low, factors_b[0]], name + "/lora_B/MatMul")
        return self.node("Add", [y, update], name + "/lora/Add")

    def weight(self, kernel, name):
        """`kernel` (K, N) written once as a `MatMul` weight: float32, or
        `MatMulNBits` codes and `(N, blocks)` scales with `self.bits`; the
        returned description is what `apply` (and, for a tied table,
        `gather_rows`) reads."""
        k, n = kernel.shape
        if self.bits is None:
            return dict(k=k, n=n, weight=self.const(kernel, name + ".weight"))
        stored, scales = onnx_quantize.nbits_weight(kernel, self.bits, self.block_size)
        return dict(k=k, n=n, stored_shape=stored.shape,
                    weight=self.const(stored, name + f".weight_q{self.bits}"),
                    scales=self.const(scales.reshape(n, -1), name + ".weight_scales"))

    def tied_table(self, table, name):
        """A tied `(vocabulary, hidden)` table as the head's `weight()`
        description, written once: quantized, as the head's `(hidden,
        vocabulary)` weight; in float32, as the table itself (`apply` reads it
        transposed, `gather_rows` looks rows up in it)."""
        if self.bits is not None:
            return self.weight(table.T, name)
        n, k = table.shape
        return dict(k=k, n=n, table=self.const(table, "model.embed_tokens.weight"))

    def apply(self, x, weight, bias, name):
        """`x @ weight (+ bias)` for a `weight()` or `tied_table()` description."""
        if "table" in weight:
            # x (B, T, K) as rows, times the (N, K) table transposed, back to
            # (B, T, N): Gemm reads B transposed in place (and onnxruntime
            # packs it as it packs a MatMul weight).
            rows_shape = self.const(np.array([-1, weight["k"]], np.int64), name + "/rows_shape")
            rows = self.node("Reshape", [x, rows_shape], name + "/Reshape")
            y = self.node("Gemm", [rows, weight["table"]], name + "/Gemm", transB=1)
            batch_time = self.node("Slice", [self.node("Shape", [x], name + "/Shape"),
                                             self.const(np.array([0], np.int64), name + "/starts"),
                                             self.const(np.array([2], np.int64), name + "/ends")],
                                   name + "/Slice")
            shape = self.node("Concat", [batch_time, self.const(np.array([weight["n"]], np.int64), name + "/n")],
                              name + "/Concat", axis=0)
            y = self.node("Reshape", [y, shape], name + "/Reshape_back")
        elif self.bits is None:
            y = self.node("MatMul", [x, weight["weight"]], name + "/MatMul")
        else:
            y = self.node(
                "MatMulNBits", [x, weight["weight"], weight["scales"]], name + "/MatMulNBits", domain=MS_DOMAIN,
                K=weight["k"], N=weight["n"], bits=self.bits, block_size=self.block_size,
                accuracy_level=self.accuracy_level,
            )
        if bias is not None and np.any(bias):
            y = self.node("Add", [y, self.const(bias, name + ".bias")], name + "/Add")
        return y

    def matmul(self, x, kernel, bias, name):
        """`x @ kernel (+ bias)`: float32, or MatMulNBits with `self.bits`."""
        return self.apply(x, self.weight(kernel, name), bias, name)

    def gather_rows(self, weight, ids, name):
        """Rows `ids` of the table of the `tied_table()` description
        `weight`: the model keeps one copy of the table, as the GenAI model
        builder does. Float32: a `Gather` of the table. Quantized:
        `GatherBlockQuantized` on the head's own codes and scales, so the
        looked-up rows are the head's quantized values."""
        if "table" in weight:
            return self.node("Gather", [weight["table"], ids], name + "/Gather")
        n, blocks, row_bytes = weight["stored_shape"]
        flat = self.const(np.array([n, blocks * row_bytes], np.int64), name + "/codes_shape")
        codes = self.node("Reshape", [weight["weight"], flat], name + "/Reshape")
        rows = self.node("GatherBlockQuantized", [codes, ids, weight["scales"]], name + "/GatherBlockQuantized",
                         domain=MS_DOMAIN, bits=self.bits, block_size=self.block_size, gather_axis=0,
                         quantize_axis=1)
        if blocks * self.block_size == weight["k"]:
            return rows
        # Rows are padded to whole blocks: cut back to the hidden size.
        starts = self.const(np.array([0], np.int64), name + "/slice_starts")
        ends = self.const(np.array([weight["k"]], np.int64), name + "/slice_ends")
        axes = self.const(np.array([-1], np.int64), name + "/slice_axes")
        return self.node("Slice", [rows, starts, ends, axes], name + "/Slice")


def decoder_model_proto(model, *, max_length, bits=None, block_size=32, accuracy_level=4, opset=17,
                        external_data=None, prompt_logits="last", shared=None, adapters=None):
    """The GenAI decoder graph of `model` (a `DecoderOnlyLM`) as an ONNX
    `ModelProto` with onnxruntime's fused ops (see the module docstring).

    Args:
        model: a built `DecoderOnlyLM` with rotary positions and RMSNorm.
        max_length: the cache length (prompt and generated tokens).
        bits: None (float32 weights), 8 or 4 (`MatMulNBits`).
        block_size: quantization block along the input axis (power of 2, >= 16).
        accuracy_level: `MatMulNBits`' `accuracy_level` (4: int8 arithmetic
            where the CPU has it; 0: as the weights).
        opset: the ONNX opset.
        external_data: None (weights inside the proto, under 2 GB in all), or
            the path of a file to write the weights to as they are made (the
            proto then refers to it by its file name: save the proto in the
            same folder).
        prompt_logits: "last": `logits` is `(B, 1, V)`, each row's last
            token (what generation reads; GenAI takes a graph whose logits
            have a static 1 there as one that computes only those); the last
            layer's output projection, feed-forward, final norm and head run
            on that row only. "all": `(B, T, V)`, every position.
        shared: None, or a dict that receives `{initializer name: array}`
            for each weight written to `external_data` exactly as the model
            holds it in memory (a read-only view of its variable): a check
            can run the graph on those arrays (onnxruntime's
            `SessionOptions.add_initializer`) instead of a second copy.
        adapters: None (LoRA adapters merged into the weights), or a dict
            that receives `adapter_weights(description)`: each PEFT-style
            adapter's A `(in, r)` and `scale * B` `(r, out)` become graph
            inputs named as Olive names them
            (`model.layers.0.self_attn.q_proj.lora_A.weight`), the rank axis
            `lora_r`, each by default empty (rank 0: the base model), as
            ONNX Runtime's LoRA adapters (`.onnx_adapter`) feed them; the
            base weights are written without the adapters (quantized with
            `bits`; the adapters stay float32).

    Raises:
        NotFusableError: `model` has an option the writer does not cover.
    """
    description = check_fusable_decoder(model, max_length, adapters is not None)
    checks.check_choice("prompt_logits", prompt_logits, PROMPT_LOGITS)
    if bits not in (None, 4, 8):
        raise ValueError(f"Received an invalid value for argument `bits`, expected None, 4 or 8. Received: bits={bits!r}")
    with contextlib.ExitStack() as stack:
        data_file = None if external_data is None else stack.enter_context(open(external_data, "wb"))
        return _decoder_graph(description, DecoderGraph(bits, block_size, accuracy_level, data_file, shared,
                                                        adapters),
                              max_length, opset, prompt_logits == "last")


def _decoder_graph(d, graph, max_length, opset, last_only):
    """The graph of the description `d` (a `keras_attn.description.Decoder`)."""
    import onnx
    from onnx import TensorProto
    from onnx import helper

    first = d.layers[0].attention
    heads, kv_heads, head_dim = first.num_heads, first.num_key_value_heads, first.head_dim

    # seqlens_k = tokens per row - 1; total_sequence_length = mask width.
    one = graph.const(np.array([1], np.int64), "/model/constants/INT64/[1]")
    total_tokens = graph.node("ReduceSum", ["attention_mask", one], "/model/attn_mask/ReduceSum", keepdims=0)
    seqlens64 = graph.node("Sub", [total_tokens, one], "/model/attn_mask/Sub")
    seqlens = graph.node("Cast", [seqlens64], "/model/attn_mask/Sub/Cast", to=TensorProto.INT32)
    width = graph.node("Shape", ["attention_mask"], "/model/attn_mask/Shape")
    width = graph.node("Gather", [width, graph.const(np.array(1, np.int64), "/model/constants/INT64/1")],
                       "/model/attn_mask/Gather", axis=0)
    total = graph.node("Cast", [width], "/model/attn_mask/Gather/Cast", to=TensorProto.INT32)

    table = d.embedding.read()
    if d.tied:
        head = graph.tied_table(table, "/lm_head")
        x = graph.gather_rows(head, "input_ids", "/model/embed_tokens")
    else:
        head = None
        x = graph.node("Gather", [graph.const(table, "model.embed_tokens.weight"), "input_ids"],
                       "/model/embed_tokens/Gather")
    del table
    if d.embedding_scale is not None:
        scale = graph.const(np.array(d.embedding_scale, np.float32), "/model/constants/embedding_scale")
        x = graph.node("Mul", [x, scale], "/model/embed_tokens/Mul")

    caches = []  # (RotaryEmbedding layer, [cos, sin] names): layers share their rotary

    def rotary_inputs(rotary):
        if rotary is None:
            return ["", ""]
        for layer, names in caches:
            if layer is rotary.layer:
                return names
        cos, sin = rotary.tables(max_length)
        suffix = f"_{len(caches)}" if caches else ""
        names = [graph.const(cos, "cos_cache" + suffix), graph.const(sin, "sin_cache" + suffix)]
        caches.append((rotary.layer, names))
        return names

    residual, pending = x, None  # pending: the last sublayer output not yet added
    for i, layer in enumerate(d.layers):
        base = f"/model/layers.{i}"
        attention = layer.attention
        residual, h = _norm(graph, residual, pending, layer.attention_norm, f"{base}/input_layernorm")
        parts = [(f"{base}/{_PROJECTION_NODES[k]}", getattr(attention, k)) for k in ("query", "key", "value")]
        kernel = np.concatenate([graph.kernel(dense) for _, dense in parts], axis=1)
        sizes = [dense.kernel.shape[1] for _, dense in parts]
        qkv = graph.matmul(h, kernel, attention.packed_bias(), f"{base}/attn/qkv_proj")
        del kernel
        qkv = graph.add_adapters(h, qkv, parts, f"{base}/attn/qkv_proj")
        qkv_inputs = [qkv, "", ""]
        if attention.query_norm is not None:
            # QK-norm: RMSNorm over each head of Q and K, before the rotary
            # inside GroupQueryAttention (whose own q/k norm inputs onnxruntime
            # runs on CUDA and WebGPU only).
            sizes = graph.const(np.array(sizes, np.int64), f"{base}/attn/qkv_sizes")
            q, k, v = graph.node("Split", [qkv, sizes], f"{base}/attn/qkv_proj/Split", outputs=3, axis=-1)
            qkv_inputs = [_head_norm(graph, q, attention.query_norm, head_dim, f"{base}/attn/q_norm"),
                          _head_norm(graph, k, attention.key_norm, head_dim, f"{base}/attn/k_norm"), v]
        rotary = attention.rotary
        attn, _, _ = graph.node(
            "GroupQueryAttention",
            qkv_inputs + [f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens, total]
            + rotary_inputs(rotary),
            f"{base}/attn/GroupQueryAttention",
            outputs=[f"{base}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
            domain=MS_DOMAIN, num_heads=heads, kv_num_heads=kv_heads,
            scale=1.0 / math.sqrt(head_dim), do_rotary=int(rotary is not None), rotary_interleaved=0,
            # Both count the keys a query sees, its own included (checked
            # against Keras in tests/export/test_onnx_decoder.py).
            local_window_size=-1 if attention.window is None else int(attention.window),
            softcap=float(attention.logit_soft_cap or 0.0),
        )
        if last_only and i == d.num_layers - 1:
            # Only each row's last token reaches the logits: from here on
            # one row per sequence (the prompt's head costs T times less).
            rows = _last_rows(graph, seqlens64, opset)
            attn = graph.node("GatherND", [attn, rows], f"{base}/attn/last_token/GatherND", batch_dims=1)
            residual = graph.node("GatherND", [residual, rows], f"{base}/residual/last_token/GatherND",
                                  batch_dims=1)
        pending = _dense(graph, attn, attention.output, f"{base}/{_PROJECTION_NODES['output']}")
        pending = _rms_norm(graph, pending, layer.attention_post_norm, f"{base}/post_attention_norm")
        residual, h = _norm(graph, residual, pending, layer.feedforward_norm,
                            f"{base}/pre_feedforward_layernorm")
        nodes = {part: f"{base}/{_projection_node(part, layer.feedforward)}" for part in ("gate", "up", "fc1", "down")}
        pending = graph.feedforward(h, layer.feedforward, lambda x, part, dense: _dense(graph, x, dense, nodes[part]),
                                    lambda op: f"{base}/mlp/{op}")
        pending = _rms_norm(graph, pending, layer.feedforward_post_norm, f"{base}/post_feedforward_norm")
    _, h = _norm(graph, residual, pending, d.final_norm, "/model/norm")
    if head is None:
        logits = _dense(graph, h, d.head, "/lm_head")
    else:
        logits = graph.apply(h, head, None, "/lm_head")
    cap = d.final_logit_soft_cap
    if cap is not None:
        cap = graph.const(np.array(cap, np.float32), "/model/constants/final_logit_soft_cap")
        logits = graph.soft_cap(logits, cap, [f"/lm_head/softcap/{op}" for op in ("Div", "Tanh", "Mul")])
    # The last node writes `logits` itself: an Identity would copy them on
    # every call (16 MB for a 128-token prompt over 32000 tokens).
    last = graph.graph.node[-1]
    assert list(last.output) == [logits], (last.output, logits)
    last.output[0] = "logits"

    batch, sequence, total_dim, cache = "batch_size", "sequence_length", "total_sequence_length", int(max_length)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, sequence]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, total_dim]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                             [batch, 1 if last_only else sequence, d.vocabulary_size])]
    for i in range(d.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(
                f"past_key_values.{i}.{kind}", TensorProto.FLOAT, [batch, kv_heads, cache, head_dim]))
            outputs.append(helper.make_tensor_value_info(
                f"present.{i}.{kind}", TensorProto.FLOAT, [batch, kv_heads, cache, head_dim]))
    inputs += graph.adapter_inputs
    return graph.finish("keras_attn_decoder", inputs, outputs, [("", opset), (MS_DOMAIN, 1)], onnx.IR_VERSION)


def _dense(graph, x, dense, name):
    """`x @ kernel + bias` of a described `Dense` (with its adapter's update
    as graph inputs, when the adapters are)."""
    return graph.add_adapters(x, graph.matmul(x, graph.kernel(dense), dense.read_bias(), name), [(name, dense)], name)


def _last_rows(graph, seqlens, opset):
    """`(B, 1, 1)` int64: the position of each row's last token among this
    call's: `min(seqlens_k, T - 1)`. A prompt is right-padded in a batch
    (GenAI masks the pads), so its last token is at `seqlens_k`; a decode
    step or a later chunk ends at `T - 1`, as GroupQueryAttention places it."""
    if opset >= 15:  # Shape's start/end
        tokens = graph.node("Shape", ["input_ids"], "/model/last_token/Shape", start=1, end=2)  # [T]
    else:
        tokens = graph.node("Shape", ["input_ids"], "/model/last_token/Shape")
        tokens = graph.node("Slice", [tokens, graph.const(np.array([1], np.int64), "/model/last_token/start"),
                                      graph.const(np.array([2], np.int64), "/model/last_token/end")],
                            "/model/last_token/Slice")
    last = graph.node("Sub", [tokens, graph.const(np.array([1], np.int64), "/model/last_token/one")],
                      "/model/last_token/Sub")
    rows = graph.node("Min", [seqlens, last], "/model/last_token/Min")
    return graph.node("Reshape", [rows, graph.const(np.array([-1, 1, 1], np.int64),
                                                      "/model/last_token/shape")],
                      "/model/last_token/Reshape")


def _norm(graph, residual, pending, layer, name):
    """RMSNorm of `residual + pending` (`pending` None: of `residual`); returns
    `(new residual, normalized)`."""
    if pending is None:
        return residual, _rms_norm(graph, residual, layer, name)
    gamma = graph.const(layer.scale.read(), name + ".weight")
    # Outputs: the normalized sum, mean and inverse std (unused: unnamed, so
    # not written; named, they took a third of the kernel's time, ~1% of a
    # Qwen2.5-0.5B int4 decode step), the sum.
    outputs = [f"{name}/output_0", "", "", f"{name}/output_3"]
    graph.node("SkipSimplifiedLayerNormalization", [pending, residual, gamma],
               name + "/SkipSimplifiedLayerNorm", outputs=outputs, domain=MS_DOMAIN, epsilon=float(layer.epsilon))
    return outputs[3], outputs[0]


def _head_norm(graph, x, layer, head_dim, name):
    """RMSNorm `layer` over each `head_dim` slice of `x` `(B, T, heads * head_dim)`."""
    heads_last = graph.const(np.array([0, 0, -1, head_dim], np.int64), name + "/heads_shape")
    flat = graph.const(np.array([0, 0, -1], np.int64), name + "/flat_shape")
    x = _rms_norm(graph, graph.node("Reshape", [x, heads_last], name + "/Reshape"), layer, name)
    return graph.node("Reshape", [x, flat], name + "/Reshape_back")


def _rms_norm(graph, x, layer, name):
    """The RMSNorm `layer` of `x` over its last axis; None (a sandwich norm the block lacks): `x`."""
    if layer is None:
        return x
    return graph.node("SimplifiedLayerNormalization", [x, graph.const(layer.scale.read(), name + ".weight")],
                      name + "/SimplifiedLayerNorm", axis=-1, epsilon=float(layer.epsilon), stash_type=1)
