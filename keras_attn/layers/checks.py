"""Argument checks and serialization registration for keras_attn's layers and
models: a clear ValueError/TypeError naming the argument and the value."""

import keras

PACKAGE = "keras_attn"


def register(cls):
    """Registers `cls` for serialization as `keras_attn>ClassName`."""
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)


def check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive integer" + (" or None" if allow_none else "")
        error = TypeError if not isinstance(value, (int, float)) else ValueError
        raise error(
            f"Received an invalid value for argument `{name}`, expected "
            f"{expected}. Received: {name}={value!r}"
        )
    return value


def check_positive_float(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected a "
            f"positive finite number. Received: {name}={value!r}"
        )
    return float(value)


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected one of "
            f"{list(choices)}. Received: {name}={value!r}"
        )
    return value


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(
            f"Received an invalid value for argument `{name}`, expected a bool. "
            f"Received: {name}={value!r}"
        )
    return value


def check_block_switches(
    normalization,
    use_gated_feedforward,
    attention_use_bias,
    attention_output_use_bias,
    feedforward_use_bias,
):
    """The Transformer blocks' architecture switches (also taken by the
    generation models), validated; `attention_output_use_bias=None` follows
    `attention_use_bias`. Returns them as a dict of constructor arguments."""
    attention_use_bias = check_bool("attention_use_bias", attention_use_bias)
    return {
        "normalization": check_choice("normalization", normalization, ("layer_norm", "rms_norm")),
        "use_gated_feedforward": check_bool("use_gated_feedforward", use_gated_feedforward),
        "attention_use_bias": attention_use_bias,
        "attention_output_use_bias": check_bool(
            "attention_output_use_bias",
            attention_use_bias if attention_output_use_bias is None else attention_output_use_bias,
        ),
        "feedforward_use_bias": check_bool("feedforward_use_bias", feedforward_use_bias),
    }
