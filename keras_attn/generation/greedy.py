"""Greedy decoding that recomputes the whole prefix at every step.

Small and obviously correct, for short outputs such as the 10 characters of
an ISO date. (Cached incremental decoding belongs to the rest of
`keras_attn.generation`.)
"""

import numpy as np


def greedy_decode(model, encoder_inputs, start_id, length, batch_size=512):
    """Decodes `length` tokens for each row of `encoder_inputs`.

    Args:
        model: a Keras model `[encoder_inputs, decoder_inputs] -> logits
            (B, length, V)` (or a list/tuple whose first item is the logits),
            causal in the decoder. A model with dict inputs gets the keys
            `encoder_inputs` and `decoder_inputs`. `decoder_inputs` has the fixed shape
            `(B, length)`; positions not yet decoded hold padding id 0, which a
            causal decoder never looks at for earlier positions.
        encoder_inputs: int array `(N, T_in)`.
        start_id: id of the start token.
        length: number of tokens to produce.
        batch_size: rows per model call.

    Returns:
        int32 NumPy array `(N, length)` of predicted ids.
    """
    if not isinstance(length, int) or length < 1:
        raise ValueError(
            "Received an invalid value for argument `length`, expected a positive "
            f"integer. Received: length={length!r}"
        )
    encoder_inputs = np.asarray(encoder_inputs)
    outputs = []
    for begin in range(0, len(encoder_inputs), batch_size):
        enc = encoder_inputs[begin : begin + batch_size]
        dec = np.zeros((len(enc), length), np.int32)
        dec[:, 0] = start_id
        pred = np.zeros((len(enc), length), np.int32)
        for t in range(length):
            if isinstance(getattr(model, "input", None), dict):
                logits = model({"encoder_inputs": enc, "decoder_inputs": dec}, training=False)
            else:
                logits = model([enc, dec], training=False)
            if isinstance(logits, (list, tuple)):
                logits = logits[0]
            pred[:, t] = np.argmax(np.asarray(logits)[:, t], axis=-1)
            if t + 1 < length:
                dec[:, t + 1] = pred[:, t]
        outputs.append(pred)
    if not outputs:
        return np.zeros((0, length), np.int32)
    return np.concatenate(outputs, axis=0)
