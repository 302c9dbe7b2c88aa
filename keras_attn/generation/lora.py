"""Low-rank adapters (LoRA) on a keras_attn language model's projections.

`DecoderOnlyLM.enable_lora` / `Seq2SeqLM.enable_lora` call `enable_lora`.
Two styles:

- `"peft"` (the default): Hugging Face PEFT's LoRA. Each adapted projection
  `y = x @ W + b` (`W` of any `Dense`/`EinsumDense` layout, e.g. a query
  kernel `(hidden, heads, head_dim)`) gets `A (in, r)` and `B (r, out)`
  over its whole input and output (every head), and computes
  `y = x @ W + (alpha / r) * dropout(x) @ A @ B + b`, with `in`/`out` the
  products of the kernel's input/output axes taken in C order (the order
  of `transformers`' flattened heads). `A` starts as PEFT's
  (`kaiming_uniform_(a=sqrt(5))`: uniform in `+-1/sqrt(in)`), `B` at zero.
  Only `A` and `B` train. So the adapter is PEFT's `lora_A.weight.T`,
  `lora_B.weight.T` and converts both ways
  (`keras_attn.convert.save_peft_adapter`, `from_huggingface(adapter=...)`).
- `"keras"`: Keras's own `EinsumDense.enable_lora`, whose rank is on the
  kernel's last axis only (on a query kernel `(hidden, heads, head_dim)`:
  `A (hidden, heads, r)`, `B (r, head_dim)`, an adapter per head); biases
  stay trainable. Kept for models adapted before PEFT's meaning was the
  default.

A base quantized with Keras's `model.quantize("int8")` first (int8 kernels,
per-output-channel scales; KerasHub's "QLoRA") takes PEFT-style adapters
too: the frozen product is taken with the kernel dequantized in the compute
dtype (weight-only, as QLoRA does; Keras's own int8 inference also
quantizes the activations), its gradient rebuilding the dequantized kernel
from the int8 one rather than saving it. The projections left frozen keep
Keras's int8 forward pass (inputs quantized too) with the same input
gradient. On TensorFlow that gradient's kernel is rebuilt only once its
upstream gradient exists (`keras_attn.ops.tf_kernels.after`): rebuilt as
soon as the backward pass starts, every layer's would be alive at once.
Such adapters cannot be merged into the int8 kernel (it would be
requantized); save them with `keras_attn.convert.save_peft_adapter` or
`keras_attn.training.FitCheckpoint`.

Either way the layer's `kernel` is served merged (`W + (alpha / r) * A @ B`,
as Keras does for its own LoRA), so the model description, every export and
`.keras` saving see the adapted kernel; `.keras` and `.weights.h5` files
hold the merged kernel, not the adapters (a model loaded from one has no
adapters and the same logits; weights loaded into an adapted model become
its frozen kernels, with B back at zero and A at a fresh PEFT start, so it
trains on; `keras_attn.convert.save_peft_adapter` keeps the adapters).

A PEFT-style layer is its own `Dense`/`EinsumDense` object with its class
switched to a subclass (`LoRADense`, `LoRAEinsumDense`) that adds the
adapter to `call` and `kernel`: the layer keeps its identity, name,
variables and place in the model, which the description and the traced
searches hold on to (replacing it with a wrapper would not).
"""

import math
import string

import keras
from keras import ops

from keras_attn import checks
from keras_attn.ops import tf_kernels

# Our projection names, and the names users know from `transformers`/PEFT.
NAMES = (
    "query", "key", "value", "attention_output",
    "feedforward_gate_dense", "feedforward_intermediate_dense", "feedforward_output_dense",
)
PEFT_NAMES = {
    "q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "attention_output",
    "gate_proj": "feedforward_gate_dense", "up_proj": "feedforward_intermediate_dense",
    "down_proj": "feedforward_output_dense",
}
STYLES = ("peft", "keras")
# PEFT's `LoraConfig(lora_alpha=8)`: `enable_lora(r)` is `LoraConfig(r=r)`.
PEFT_ALPHA = 8


def enable_lora(model, rank, target_names=("query", "value"), lora_alpha=None, *,
                style="peft", dropout=0.0):
    """LoRA of `rank` on `model`'s sublayers named in `target_names`, every
    other weight frozen; returns the adapted layers. See
    `DecoderOnlyLM.enable_lora`.
    """
    rank = checks.check_positive_int("rank", rank)
    checks.check_choice("style", style, STYLES)
    if isinstance(target_names, str):
        target_names = (target_names,)
    if not model.built:
        raise ValueError("Call the model once (or build it) before `enable_lora`.")
    unknown = sorted(set(target_names) - set(NAMES) - set(PEFT_NAMES))
    if unknown:
        raise ValueError(
            f"Received an invalid value for argument `target_names`: {unknown} are not "
            f"projection names. Expected some of {list(NAMES)} or their Hugging Face "
            f"names {list(PEFT_NAMES)}. Received: target_names={tuple(target_names)}"
        )
    wanted = {PEFT_NAMES.get(name, name) for name in target_names}
    projections = [layer for layer in model._flatten_layers(include_self=False)
                   if hasattr(layer, "enable_lora")]
    targets = [layer for layer in projections if layer.name in wanted]
    missing = sorted(wanted - {layer.name for layer in targets})
    if missing:
        raise ValueError(
            f"`target_names` has names of no projection of this model: {missing}. "
            f"Expected some of {sorted({layer.name for layer in projections})}."
        )
    if style == "keras":
        if dropout:
            raise ValueError("Received an invalid value for argument `dropout`: Keras's LoRA "
                             f"(style='keras') has none. Received: dropout={dropout}")
        _freeze_all_but(model, targets)
        for layer in targets:
            layer.enable_lora(rank, lora_alpha=lora_alpha)
    else:
        adapt(model, targets, rank, PEFT_ALPHA if lora_alpha is None else lora_alpha, dropout)
    return targets


def adapt(model, layers, rank, alpha, dropout=0.0):
    """PEFT-style LoRA on `layers` (sublayers of `model`), everything else
    frozen. The one way adapters are made: by `enable_lora` and by loading a
    PEFT adapter (`keras_attn.convert.from_huggingface(adapter=...)`)."""
    rank = checks.check_positive_int("rank", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError("Received an invalid value for argument `lora_alpha`, expected a "
                         f"positive number. Received: lora_alpha={alpha!r}")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise ValueError("Received an invalid value for argument `dropout`, expected a "
                         f"number in [0, 1). Received: dropout={dropout!r}")
    for layer in layers:
        _check_adaptable(layer)
    _freeze_all_but(model, layers)
    for layer in layers:
        cls = type(layer)
        # A layer left frozen by an earlier `adapt` goes back to its own class first.
        layer.__class__ = _lora_class(cls.__bases__[1] if issubclass(cls, FrozenInt8Layer) else cls)
        layer._add_adapter(rank, alpha, float(dropout))
    for layer in model._flatten_layers(include_self=False):
        if _keras_int8(layer) and not isinstance(layer, (LoRALayer, FrozenInt8Layer)):
            layer.__class__ = _mixed_class(FrozenInt8Layer, type(layer))
    return layers


def merge_lora(model):
    """Adds each PEFT-style adapter's `(alpha / r) * A @ B` into its frozen
    kernel; the forward pass then uses the kernel alone (one matmul per
    projection). `unmerge_lora` subtracts it again. Returns the layers."""
    layers = adapted_layers(model)
    for layer in layers:
        layer._merge(1)
    reset_traces(model)
    return layers


def unmerge_lora(model):
    """Undoes `merge_lora`: the kernels lose the update, the adapters act again."""
    layers = adapted_layers(model)
    for layer in layers:
        layer._merge(-1)
    reset_traces(model)
    return layers


def adapted_layers(model):
    """The PEFT-style LoRA layers of `model`, in its layer order."""
    return [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, LoRALayer)]


def _check_adaptable(layer):
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        raise ValueError(f"Cannot adapt `{layer.path}`: LoRA adapts Dense and EinsumDense layers, "
                         f"not {type(layer).__name__}.")
    if not layer.built:
        raise ValueError(f"Cannot adapt `{layer.path}`: build it first.")
    if getattr(layer, "lora_enabled", False):
        raise ValueError(f"LoRA is already enabled on `{layer.path}`: enable it once per layer.")
    if layer.quantization_mode not in (None, "int8"):
        raise ValueError(f"Cannot adapt `{layer.path}`: PEFT-style LoRA takes a float or an int8 "
                         f"(`model.quantize('int8')`) kernel, not a {layer.quantization_mode} one.")
    if layer.kernel_constraint is not None:
        raise ValueError(f"Cannot adapt `{layer.path}`: LoRA is incompatible with its `kernel_constraint`.")


def _freeze_all_but(model, targets):
    # Top-down: the model trainable, every sublayer frozen, then the targets.
    model.trainable = True
    for layer in model._flatten_layers(include_self=False):
        layer.trainable = False
    for layer in targets:
        layer.trainable = True
    reset_traces(model)


def reset_traces(model):
    """Drops `model`'s traced `fit`/`evaluate`/`predict` steps, so the next call retraces."""
    # Keras's own traced `fit`/`evaluate`/`predict` steps hold the model as it
    # was traced, without the adapters (Keras resets them after `quantize`,
    # not after `enable_lora`).
    if isinstance(model, keras.Model):
        model.train_function = model.test_function = model.predict_function = None


def _einsum_parts(equation):
    """`(input, kernel, output)` subscripts of an EinsumDense equation."""
    inputs, output = equation.split("->")
    x, kernel = inputs.split(",")
    return x, kernel, output


def _a_initializer():
    """PEFT's `kaiming_uniform_(a=sqrt(5))` on lora_A `(r, in)`, uniform in
    +-1/sqrt(in), as an initializer of A `(in, r)`. A new one each time: an
    unseeded Keras initializer gives the same values at every call."""
    return keras.initializers.VarianceScaling(1.0 / 3.0, "fan_in", "uniform")


def _keras_int8(layer):
    """A `Dense`/`EinsumDense` that Keras runs as int8 with its inputs
    quantized, without Keras's own LoRA (whose update its call adds)."""
    return (isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
            and layer.quantization_mode == "int8" and bool(getattr(layer, "inputs_quantizer", None))
            and not getattr(layer, "lora_enabled", False))


def _dequantize(layer, kernel, scale, dtype):
    if isinstance(layer, keras.layers.EinsumDense):
        scale = layer._adjust_scale_for_dequant(scale)  # Keras's own layout for it
    return ops.divide(ops.cast(kernel, dtype), ops.cast(scale, dtype))


def _int8_product(layer, inputs, forward):
    """`forward(x, kernel, scale)` on `layer`'s int8 kernel and scale, whose
    input gradient multiplies by the kernel dequantized in the backward pass:
    not saved from the forward pass, and (`tf_kernels.after`) not rebuilt
    before its upstream gradient exists."""

    @ops.custom_gradient
    def product(x, kernel, scale):
        # Only tensors inside (TensorFlow's custom gradients treat a variable
        # read here as an input).
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            w = _dequantize(layer, *tf_kernels.after((kernel, scale), upstream), upstream.dtype)
            if isinstance(layer, keras.layers.Dense):
                return ops.matmul(upstream, ops.transpose(w)), None, None
            return ops.einsum(layer._custom_gradient_equation, upstream, w), None, None

        return forward(x, kernel, scale), grad

    return product(inputs, ops.convert_to_tensor(layer._kernel), ops.convert_to_tensor(layer.kernel_scale))


class FrozenInt8Layer:
    """A frozen int8 `Dense`/`EinsumDense` of a model with adapters (mixed in
    by `adapt`): Keras's int8 forward pass, inputs quantized per row as
    Keras does, with `_int8_product`'s input gradient."""

    def _int8_call(self, inputs, training=None):
        y = _int8_product(self, inputs, self._quantized_product)
        if self.bias is not None:
            y = ops.add(y, self.bias)
        if self.activation is not None:
            y = self.activation(y)
        return y

    def _quantized_product(self, x, kernel, scale):
        if isinstance(self, keras.layers.Dense):
            x, x_scale = self.inputs_quantizer(x, axis=-1)
            y = ops.matmul(x, kernel)
        else:
            x, x_scale = self.inputs_quantizer(x, axis=self.quantization_axis)
            x_scale = self._adjust_scale_for_quant(x_scale, "input")
            y = ops.einsum(self.equation, x, kernel)
        return ops.divide(ops.cast(y, self.compute_dtype), ops.multiply(x_scale, scale))


class LoRALayer:
    """PEFT's LoRA on a `Dense` or `EinsumDense` (mixed in by `adapt`).

    Attributes beyond the layer's: `lora_kernel_a` `(in, r)` and
    `lora_kernel_b` `(r, out)` (float32, as Keras keeps its adapters),
    `lora_rank`, `lora_alpha`, `lora_dropout`, `lora_merged`.
    """

    def _add_adapter(self, rank, alpha, dropout):
        self._lora_split()
        shape = tuple(int(d) for d in self._kernel.shape)
        in_size = int(math.prod(shape[i] for i in self._lora_in_axes))
        out_size = int(math.prod(shape[i] for i in self._lora_out_axes))
        self._tracker.unlock()
        self.lora_kernel_a = self.add_weight(
            name="lora_kernel_a", shape=(in_size, rank), dtype="float32", initializer=_a_initializer(),
        )
        self.lora_kernel_b = self.add_weight(
            name="lora_kernel_b", shape=(rank, out_size), dtype="float32", initializer="zeros",
        )
        self._lora_seed = keras.random.SeedGenerator() if dropout else None
        # Keras binds `quantize` to each layer when it is made, so a class
        # switch does not reach it.
        self.quantize = self._refuse_quantize
        self._tracker.lock()
        self._kernel.trainable = False
        if self.bias is not None:
            self.bias.trainable = False
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = alpha
        self.lora_dropout = dropout
        self.lora_merged = False

    def load_own_variables(self, store):
        # Keras's rule for a LoRA layer: the stored (merged) kernel becomes the
        # frozen one and the adapters restart at zero. Zero A and B would get
        # zero gradients, so A restarts as PEFT's instead (B stays zero: the
        # loaded model's outputs are the stored ones).
        super().load_own_variables(store)
        self.lora_kernel_a.assign(_a_initializer()(self.lora_kernel_a.shape, "float32"))
        self.lora_merged = False

    def _lora_split(self):
        """Which kernel axes are the input's and which the output's, and the
        two einsum equations of the adapter's path."""
        if isinstance(self, keras.layers.Dense):
            self._lora_in_axes, self._lora_out_axes = (0,), (1,)
            self._lora_delta_equation = "az,zb->ab"
            self._lora_equations = None
            return
        x, kernel, output = _einsum_parts(self.equation)
        shared = [c for c in kernel if c in x and c in output]
        if shared or any(c not in x and c not in output for c in kernel):
            raise ValueError(f"Cannot adapt `{self.path}`: its kernel axes {kernel!r} are not "
                             f"each an input or an output axis (equation {self.equation!r}).")
        rank_letter = next(c for c in string.ascii_letters if c not in self.equation)
        ins = "".join(c for c in kernel if c in x)
        outs = "".join(c for c in kernel if c in output)
        rest = "".join(c for c in output if c not in kernel)
        self._lora_in_axes = tuple(kernel.index(c) for c in ins)
        self._lora_out_axes = tuple(kernel.index(c) for c in outs)
        self._lora_delta_equation = f"{ins}{rank_letter},{rank_letter}{outs}->{kernel}"
        self._lora_equations = (f"{x},{ins}{rank_letter}->{rest}{rank_letter}",
                                f"{rest}{rank_letter},{rank_letter}{outs}->{output}")

    def _lora_factors(self):
        """`A`, `B` shaped as the kernel's input axes + `(r,)` and `(r,)` +
        its output axes."""
        shape = tuple(int(d) for d in self._kernel.shape)
        a = ops.reshape(self.lora_kernel_a, tuple(shape[i] for i in self._lora_in_axes) + (self.lora_rank,))
        b = ops.reshape(self.lora_kernel_b, (self.lora_rank,) + tuple(shape[i] for i in self._lora_out_axes))
        return a, b

    def _float_kernel(self, dtype):
        """The frozen kernel in `dtype`: an int8 one dequantized."""
        if self.quantization_mode is None:
            return ops.cast(self._kernel, dtype)
        return _dequantize(self, self._kernel, self.kernel_scale, dtype)

    def _product(self, x, kernel):
        return ops.matmul(x, kernel) if self._lora_equations is None else ops.einsum(self.equation, x, kernel)

    def _frozen_product(self, inputs):
        """`inputs` times the frozen kernel, without bias or adapter; an int8
        kernel dequantized in the compute dtype (weight-only)."""
        if self.quantization_mode is None:
            return self._product(inputs, self._kernel)
        return _int8_product(self, inputs, lambda x, kernel, scale: self._product(
            x, _dequantize(self, kernel, scale, x.dtype)))

    def quantized_call(self, *args, **kwargs):
        # Keras routes a quantized layer's calls here, not to `call`.
        return self.call(*args, **kwargs)

    def _refuse_quantize(self, mode=None, **kwargs):
        raise ValueError(f"Cannot quantize `{self.path}`: it has LoRA adapters. Quantize the model "
                         "first (`model.quantize('int8')`), then call `enable_lora`.")

    def _get_kernel_with_merged_lora(self):
        # What Keras saves in `.keras`/`.weights.h5`: the merged kernel.
        if self.quantization_mode is not None:
            raise ValueError(
                f"Cannot save `{self.path}` to a Keras file: its adapters cannot be merged into "
                "its int8 kernel. Save them with `keras_attn.convert.save_peft_adapter`, or the "
                "whole training state with `keras_attn.training.FitCheckpoint`.")
        return super()._get_kernel_with_merged_lora()

    def lora_delta(self):
        """`(alpha / r) * A @ B` in the kernel's shape (float32)."""
        a, b = self._lora_factors()
        a = ops.cast(a, "float32")
        b = ops.cast(b, "float32")
        return ops.multiply(ops.einsum(self._lora_delta_equation, a, b), self.lora_alpha / self.lora_rank)

    @property
    def kernel(self):
        if self.lora_merged:
            return self._kernel
        merged = ops.add(self._float_kernel("float32"), self.lora_delta())
        return ops.cast(merged, self.compute_dtype)

    def _merge(self, sign):
        if self.lora_merged == (sign > 0):
            return
        if self.quantization_mode is not None:
            raise ValueError(f"Cannot merge the adapters of `{self.path}` into its int8 kernel "
                             "(it would be requantized): keep them unmerged, or save them with "
                             "`keras_attn.convert.save_peft_adapter`.")
        value = ops.add(ops.cast(self._kernel, "float32"), sign * self.lora_delta())
        self._kernel.assign(ops.cast(value, self._kernel.dtype))
        self.lora_merged = sign > 0

    @property
    def frozen_kernel(self):
        """The kernel without the unmerged adapter (with it once merged)."""
        return self._kernel

    def lora_update(self, inputs, training=None, dtype=None):
        """`(alpha / r) * dropout(inputs) @ A @ B` in the output's shape
        (without bias) and `dtype` (default the compute dtype), or None
        once merged. The fused projections add it to their product with
        `frozen_kernel` (`keras_attn.layers._projections`)."""
        if self.lora_merged:
            return None
        dtype = dtype or self.compute_dtype
        x = inputs
        if training and self.lora_dropout:
            x = keras.random.dropout(x, self.lora_dropout, seed=self._lora_seed)
        a, b = self._lora_factors()
        a, b = ops.cast(a, dtype), ops.cast(b, dtype)
        if self._lora_equations is None:  # Dense
            update = ops.matmul(ops.matmul(x, a), b)
        else:
            update = ops.einsum(self._lora_equations[1], ops.einsum(self._lora_equations[0], x, a), b)
        return ops.multiply(update, ops.cast(self.lora_alpha / self.lora_rank, dtype))

    def call(self, inputs, training=None):
        y = self._frozen_product(inputs)
        update = self.lora_update(inputs, training, y.dtype)
        if update is not None:
            y = ops.add(y, update)
        if self.bias is not None:
            y = ops.add(y, self.bias)
        if self.activation is not None:
            y = self.activation(y)
        return y


_CLASSES = {}


def _mixed_class(mixin, cls):
    """The subclass of `cls` (`Dense`, `EinsumDense` or a subclass) with
    `mixin` first, made once per pair."""
    if (mixin, cls) not in _CLASSES:
        name = mixin.__name__.removesuffix("Layer") + cls.__name__  # LoRADense, FrozenInt8EinsumDense
        _CLASSES[mixin, cls] = type(name, (mixin, cls), {"__module__": __name__})
    return _CLASSES[mixin, cls]


def _lora_class(cls):
    """The subclass of `cls` with PEFT's LoRA."""
    return _mixed_class(LoRALayer, cls)
