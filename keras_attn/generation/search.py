"""Cached generation: greedy, sampling (temperature / top-k / top-p) and beam search.

Each search is one `tf.function` (XLA-compatible with `jit_compile=True`):
a prefill call over the (right-padded) prompt fills the cache, then a
`tf.while_loop` feeds one token per step at `cache_index`, stopping at
`max_length` or when every row has produced a stop token. Rows whose prompt
is longer than the shortest one keep their prompt tokens until their prompt
ends (so each row decodes exactly as it would alone, with right padding and
no padding mask). After a row stops, it is filled with `pad_token_id`.

The model must offer `init_cache`, `call_with_cache` and, for
encoder-decoder models, `encode` (see `keras_attn.generation.models`).

TensorFlow is required here, by design: the searches are TensorFlow graphs
(`tf.function`, `tf.while_loop`, XLA) that also export as serving signatures
(`keras_attn.runtimes.signatures`), so they run with the TensorFlow Keras
backend only (checked, docs/architecture.md). The models and caches are
`keras.ops` and run on every backend.
"""

import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_attn.structure import Structure

_NEG = -1.0e9
# model -> (its Structure when traced, {search key: tf.function})
_FUNCTIONS = weakref.WeakKeyDictionary()


def as_token_ids(name, ids):
    """`ids` as a `(batch, length)` integer tensor or array, validated early.

    Python lists and NumPy arrays are accepted (and converted); tensors are
    kept. Raises a ValueError naming `name` for another rank, a non-integer
    dtype or ragged rows.
    """
    if not tf.is_tensor(ids):
        try:
            ids = np.asarray(ids)
        except ValueError as error:
            raise ValueError(
                f"`{name}` must be a rectangular `(batch, length)` array of token ids "
                f"(right-pad shorter rows with the pad id). Received: {name}={ids!r}"
            ) from error
    if len(ids.shape) != 2:
        raise ValueError(
            f"`{name}` must be a 2-D `(batch, length)` array of token ids (a single "
            f"sequence is `[ids]`). Received: {name}.shape={tuple(ids.shape)}"
        )
    if tf.is_tensor(ids):
        integer, empty = ids.dtype.is_integer, ids.shape.num_elements() == 0
    else:
        integer, empty = np.issubdtype(ids.dtype, np.integer), ids.size == 0
    if not (integer or empty):  # an empty prompt is reported by its shape
        raise ValueError(
            f"`{name}` must hold integer token ids. Received: {name} with dtype={ids.dtype}"
        )
    return ids


def check_max_positions(model, max_length, encoder_length=None):
    """Checks lengths against `model.max_positions` (a learned table), if any.

    Under XLA a position past a learned table is clamped to its last row
    instead of raising, so this is checked before tracing.
    """
    capacity = getattr(model, "max_positions", None)
    if capacity is None:
        return
    if max_length > capacity:
        raise ValueError(
            f"`max_length` must be at most the number of positions the model can "
            f"embed, model.max_positions={capacity} (its learned position table, "
            f"`sequence_length`). Received: max_length={max_length}. Use a model "
            "with a longer table or sinusoidal/rotary positions, which extrapolate."
        )
    if encoder_length is not None and encoder_length > capacity:
        raise ValueError(
            f"`encoder_ids` may be at most model.max_positions={capacity} tokens long "
            f"(its learned position table). Received: encoder length={encoder_length}"
        )


def _check(model, max_length, prompt_ids, encoder_ids, stop_token_ids):
    """Validates the common arguments; returns `(prompt_ids, encoder_ids, stops)`."""
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "keras_attn's cached searches (greedy_search, random_sampling, "
            "beam_search) are TensorFlow graphs and need the TensorFlow Keras "
            f"backend. Received: backend={keras.backend.backend()!r}; set "
            "KERAS_BACKEND=tensorflow, or call the model's `call_with_cache` "
            "in your own loop."
        )
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(
            "Received an invalid value for argument `max_length`, expected a "
            f"positive integer. Received: max_length={max_length!r}"
        )
    prompt_ids = as_token_ids("prompt_ids", prompt_ids)
    width = prompt_ids.shape[1]
    if width is None or width < 1 or width > max_length:
        raise ValueError(
            "`prompt_ids` must be `(batch, prompt_width)` with 1 <= prompt_width "
            f"<= max_length={max_length}. Received: prompt_ids.shape={tuple(prompt_ids.shape)}"
        )
    if encoder_ids is not None:
        encoder_ids = as_token_ids("encoder_ids", encoder_ids)
    check_max_positions(model, max_length,
                        None if encoder_ids is None else encoder_ids.shape[1])
    return prompt_ids, encoder_ids, tuple(int(t) for t in stop_token_ids)


def _left_padded(prompt_ids, attention_mask, max_length, pad_token_id):
    """Hugging Face's padded batches (`attention_mask`, 1 = token, usually
    left-padded) onto the searches' right-padded rows.

    Returns `(compact_ids, restore)`: each row's tokens moved to the front
    (so every row decodes from its own position 0, which is what Hugging
    Face's per-row `position_ids` from the mask achieve), and `restore(tokens)`
    giving the Hugging Face layout: the prompt as given, then
    `max_length - prompt_width` new tokens per row.
    """
    mask = as_token_ids("attention_mask", attention_mask)
    if tuple(mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(
            "`attention_mask` must have the shape of `prompt_ids`. Received: "
            f"attention_mask.shape={tuple(mask.shape)}, prompt_ids.shape={tuple(prompt_ids.shape)}"
        )
    mask = tf.not_equal(tf.cast(mask, tf.int32), 0)
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    if tf.executing_eagerly() and bool(tf.reduce_any(lengths == 0)):
        raise ValueError(
            "Every row of `attention_mask` needs at least one token (a 1). Received rows "
            f"without any: {np.flatnonzero(lengths.numpy() == 0).tolist()}"
        )
    prompt_ids = tf.cast(prompt_ids, tf.int32)
    order = tf.argsort(tf.cast(tf.logical_not(mask), tf.int32), axis=1, stable=True)
    compact = tf.gather(prompt_ids, order, batch_dims=1)
    compact = tf.where(tf.gather(mask, order, batch_dims=1), compact, pad_token_id)
    width = prompt_ids.shape[1]

    def restore(tokens):
        new = lengths[:, None] + tf.range(max_length - width)[None, :]
        return tf.concat([prompt_ids, tf.gather(tokens, new, batch_dims=1)], axis=1)

    return compact, restore


def _check_top_k(top_k, vocabulary_size):
    # Not clamped: like KerasHub's `TopKSampler` (whose `top_k` call fails),
    # a `top_k` larger than the vocabulary is an error, reported clearly.
    if vocabulary_size is not None and top_k > vocabulary_size:
        raise ValueError(
            f"`top_k` must be at most the vocabulary size ({vocabulary_size}). "
            f"Received: top_k={top_k}"
        )


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Temperature scaling, then top-k and top-p (nucleus) filtering of `(B, V)` logits.

    Filtered-out entries are set to -1e9. Top-p keeps the smallest set of
    most likely tokens whose probability reaches `top_p` (at least one).
    `top_k` larger than the vocabulary `V` raises a ValueError (it is not
    clamped), as with KerasHub's `TopKSampler`.
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0. Received: temperature={temperature!r}")
    logits = tf.cast(logits, tf.float32) / temperature
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"`top_k` must be a positive int. Received: top_k={top_k!r}")
        _check_top_k(top_k, logits.shape[-1])
        kth = tf.math.top_k(logits, k=top_k).values[:, -1:]
        logits = tf.where(logits < kth, _NEG, logits)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1]. Received: top_p={top_p!r}")
        sorted_logits = tf.sort(logits, axis=-1, direction="DESCENDING")
        probs = tf.nn.softmax(sorted_logits, axis=-1)
        before = tf.cumsum(probs, axis=-1, exclusive=True)
        keep = before < top_p
        # The smallest kept logit is the threshold (the first is always kept).
        threshold = tf.reduce_min(tf.where(keep, sorted_logits, tf.float32.max), axis=-1, keepdims=True)
        logits = tf.where(logits < threshold, _NEG, logits)
    return logits


_MASK32 = 0xFFFFFFFF


def _hash32(x):
    """A 32-bit integer mixer in int64 arithmetic (products stay below 2**63)."""
    for _ in range(2):
        x = tf.bitwise.bitwise_xor(tf.bitwise.right_shift(x, 16), x)
        x = tf.bitwise.bitwise_and(x * 0x45D9F3B, _MASK32)
    return tf.bitwise.bitwise_xor(tf.bitwise.right_shift(x, 16), x)


def counter_uniform(shape, seed, step):
    """Uniforms in (0, 1) of `shape` (B, V), a pure function of `(seed, step, b, v)`.

    A counter-based hash in integer ops, so the draws are identical with and
    without XLA (TensorFlow's stateless RNGs change algorithm under XLA).
    """
    h = _hash32(tf.bitwise.bitwise_and(tf.cast(seed, tf.int64), _MASK32))
    h = _hash32(tf.bitwise.bitwise_xor(h, tf.cast(step, tf.int64)))
    rows = tf.range(tf.cast(shape[0], tf.int64))[:, None]
    cols = tf.range(tf.cast(shape[1], tf.int64))[None, :]
    h = _hash32(tf.bitwise.bitwise_xor(h, rows))
    h = _hash32(tf.bitwise.bitwise_xor(h, cols))
    # 24 random bits: exactly representable in float32, never 0 or 1.
    bits = tf.cast(tf.bitwise.right_shift(h, 8), tf.float32)
    return (bits + 0.5) / float(1 << 24)


def _column(x, index):
    return tf.gather(x, index, axis=1)


def _write_column(buffer, index, values):
    hit = tf.equal(tf.range(tf.shape(buffer)[1]), index)
    return tf.where(hit[None, :], values[:, None], buffer)


def _prefill(model, prompt_ids, max_length, encoder_ids, start):
    """Fills the cache from the prompt; returns `(cache, kwargs, start)`.

    The loop then feeds the token at `start - 1` again and goes on in order.
    A ring-buffer cache (a sliding window shorter than `max_length`) keeps
    only the last `window` positions written, so the loop may not step back
    over a longer prefill: unless every row fills the prompt width, only the
    first token is prefilled and the loop feeds the rest of the prompts one
    by one (`start = 1`). Both branches have static shapes (XLA-compatible).
    """
    batch = tf.shape(prompt_ids)[0]
    cache = model.init_cache(batch, max_length)
    kwargs, call_kwargs = {}, {}
    if encoder_ids is not None:
        encoded, enc_mask = model.encode(encoder_ids)
        call_kwargs = {"encoder_outputs": encoded, "encoder_padding_mask": enc_mask}
        kwargs = {"encoder_padding_mask": enc_mask}

    def prefill(ids):
        return model.call_with_cache(ids, cache, 0, **call_kwargs)[1]

    width = prompt_ids.shape[1]
    lengths = [t.shape[1] for t in tf.nest.flatten(cache) if t is not None and len(t.shape) == 4]
    ring = any(n is not None and n < max_length for n in lengths)
    if not ring or width == 1:
        return prefill(prompt_ids), kwargs, start
    traced = []

    def branch(ids):
        # tf.cond returns tensors only: drop the None leaves, restore them below.
        traced.append(prefill(ids))
        return [t for t in tf.nest.flatten(traced[-1]) if t is not None]

    # A serving signature's prompt width is dynamic.
    full = tf.equal(start, width if width is not None else tf.shape(prompt_ids)[1])
    tensors = iter(tf.cond(full, lambda: branch(prompt_ids), lambda: branch(prompt_ids[:, :1])))
    leaves = tf.nest.flatten(traced[0])
    cache = tf.nest.pack_sequence_as(
        traced[0], [None if t is None else next(tensors) for t in leaves]
    )
    return cache, kwargs, tf.where(full, start, 1)


def _buffers(prompt_ids, max_length, pad_token_id):
    prompt_ids = tf.cast(prompt_ids, tf.int32)
    width = prompt_ids.shape[1] if prompt_ids.shape[1] is not None else tf.shape(prompt_ids)[1]
    mask = tf.not_equal(prompt_ids, pad_token_id)
    padding = [[0, 0], [0, max_length - width]]
    tokens = tf.pad(prompt_ids, padding, constant_values=pad_token_id)
    mask = tf.pad(mask, padding, constant_values=False)
    # Static (batch, max_length) shapes for the loop, whatever the prompt
    # width; a batch of one must stay 1, not None, or the cache written from
    # these tokens loses its static batch after one iteration.
    batch = -1 if prompt_ids.shape[0] is None else prompt_ids.shape[0]
    tokens = tf.reshape(tokens, (batch, max_length))
    mask = tf.reshape(mask, (batch, max_length))
    start = tf.maximum(tf.reduce_min(tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)), 1)
    return tokens, mask, start


def decode_loop(model, prompt_ids, encoder_ids, max_length, stop_token_ids, pad_token_id, select):
    """The searches' loop, unchecked, for use inside a `tf.function` (the greedy
    and sampling searches, and the exported `generate` signature of
    `keras_attn.runtimes.signatures`): prefill, then one token per step chosen by
    `select(logits (B, V), index) -> ids (B,)`; returns `(B, max_length)` tokens."""
    tokens, prompt_mask, start = _buffers(prompt_ids, max_length, pad_token_id)
    cache, kwargs, start = _prefill(model, tf.cast(prompt_ids, tf.int32), max_length,
                                    encoder_ids, start)
    batch = tf.shape(tokens)[0]
    stops = tf.constant(stop_token_ids or (-1,), tf.int32)

    def cond(index, tokens, cache, done):
        return tf.logical_and(index < max_length, tf.logical_not(tf.reduce_all(done)))

    def body(index, tokens, cache, done):
        previous = _column(tokens, index - 1)[:, None]
        logits, cache = model.call_with_cache(previous, cache, index - 1, **kwargs)
        chosen = tf.cast(select(logits[:, 0, :], index), tf.int32)
        in_prompt = _column(prompt_mask, index)
        chosen = tf.where(done, pad_token_id, chosen)
        chosen = tf.where(in_prompt, _column(tokens, index), chosen)
        stopped = tf.reduce_any(tf.equal(chosen[:, None], stops[None, :]), axis=1)
        done = tf.logical_or(done, tf.logical_and(tf.logical_not(in_prompt), stopped))
        return index + 1, _write_column(tokens, index, chosen), cache, done

    done = tf.zeros((batch,), tf.bool)
    _, tokens, _, _ = tf.while_loop(cond, body, (start, tokens, cache, done))
    return tokens


def _compiled(model, key, build, jit_compile):
    # A trace holds the model as it was traced: after `enable_lora`,
    # `quantize`, a `trainable` flip or a replaced layer, every search of the
    # model is traced anew (and the old traces are let go).
    structure = Structure(model)
    traced_for, table = _FUNCTIONS.get(model, (None, None))
    if traced_for != structure:
        table = {}
        _FUNCTIONS[model] = (structure, table)
    if key not in table:
        table[key] = tf.function(build, jit_compile=jit_compile, reduce_retracing=True)
    return table[key]


def _run(model, key, loop, prompt_ids, encoder_ids, jit_compile, *extra):
    fn = _compiled(model, key + (encoder_ids is not None, jit_compile), loop, jit_compile)
    prompt_ids = tf.cast(prompt_ids, tf.int32)  # any integer dtype (checked in `_check`)
    if encoder_ids is not None:
        encoder_ids = tf.cast(encoder_ids, tf.int32)
    return fn(prompt_ids, encoder_ids, *extra)


def greedy_search(model, prompt_ids, max_length, *, encoder_ids=None, stop_token_ids=(),
                  pad_token_id=0, jit_compile=False, attention_mask=None):
    """Greedy cached decoding.

    Args:
        model: a model with `init_cache`, `call_with_cache` (and `encode`).
        prompt_ids: `(B, P)` right-padded int prompt (pad = `pad_token_id`);
            each row needs at least one token (the start token). A nested
            list, NumPy array or tensor of any integer dtype.
        max_length: length of the returned sequences (prompt included), and
            of the cache. At most `model.max_positions` when the model has
            one (a learned position table): checked up front, since XLA
            would clamp positions past the table silently.
        encoder_ids: `(B, T_enc)` encoder input for encoder-decoder models.
        stop_token_ids: generation stops in a row after one of these.
        pad_token_id: padding id of the prompt and of finished rows.
        jit_compile: compile the whole loop with XLA.
        attention_mask: optional `(B, P)`, 1 = token, 0 = padding, for
            Hugging Face-style batches (left-padded, as `generate` takes
            them; any padding side works). Each row then decodes from its
            own first token (positions per row, as Hugging Face derives them
            from the mask), and the result has Hugging Face's layout: the
            prompt as given, then `max_length - P` new tokens per row. The
            prompt's real tokens must differ from `pad_token_id` (it fills
            finished rows).

    Returns:
        `(B, max_length)` int32 tokens (a tf.Tensor).
    """
    prompt_ids, encoder_ids, stops = _check(model, max_length, prompt_ids, encoder_ids,
                                            stop_token_ids)
    restore = None
    if attention_mask is not None:
        prompt_ids, restore = _left_padded(prompt_ids, attention_mask, max_length, pad_token_id)

    def loop(prompt_ids, encoder_ids):
        return decode_loop(model, prompt_ids, encoder_ids, max_length, stops, pad_token_id,
                            lambda logits, index: tf.argmax(logits, axis=-1))

    tokens = _run(model, ("greedy", max_length, stops, pad_token_id), loop, prompt_ids,
                  encoder_ids, jit_compile)
    return tokens if restore is None else restore(tokens)


def random_sampling(model, prompt_ids, max_length, *, seed, temperature=1.0, top_k=None,
                    top_p=None, encoder_ids=None, stop_token_ids=(), pad_token_id=0,
                    jit_compile=False, attention_mask=None):
    """Cached sampling with temperature, top-k and top-p, reproducible from `seed`.

    Each step draws by the Gumbel-max trick from `counter_uniform(seed,
    position)`, so a given seed gives the same tokens every run, with
    or without XLA. `top_k` may not exceed the vocabulary size (a
    ValueError; it is not clamped, as with KerasHub's `TopKSampler`). Other
    arguments as `greedy_search`.
    """
    prompt_ids, encoder_ids, stops = _check(model, max_length, prompt_ids, encoder_ids,
                                            stop_token_ids)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"`seed` must be an int. Received: seed={seed!r}")
    filter_logits(tf.zeros((1, 2)), temperature, None, top_p)  # argument checks
    if top_k is not None:
        filter_logits(tf.zeros((1, top_k)), temperature, top_k, None)
        _check_top_k(top_k, getattr(model, "vocabulary_size", None))
    restore = None
    if attention_mask is not None:
        prompt_ids, restore = _left_padded(prompt_ids, attention_mask, max_length, pad_token_id)

    def select(logits, index, seed):
        filtered = filter_logits(logits, temperature, top_k, top_p)
        uniform = counter_uniform(tf.shape(filtered), seed, index)
        # Gumbel-max: argmax(logits + Gumbel noise) samples softmax(logits).
        return tf.argmax(filtered - tf.math.log(-tf.math.log(uniform)), axis=-1,
                         output_type=tf.int32)

    def loop(prompt_ids, encoder_ids, seed):
        # The seed is an input, so a new seed does not retrace.
        return decode_loop(model, prompt_ids, encoder_ids, max_length, stops, pad_token_id,
                            lambda logits, index: select(logits, index, seed))

    key = ("sample", max_length, stops, pad_token_id, temperature, top_k, top_p)
    tokens = _run(model, key, loop, prompt_ids, encoder_ids, jit_compile,
                  tf.constant(seed, tf.int64))
    return tokens if restore is None else restore(tokens)


def beam_search(model, prompt_ids, max_length, *, num_beams=4, encoder_ids=None,
                stop_token_ids=(), pad_token_id=0, jit_compile=False, return_scores=False,
                attention_mask=None):
    """Cached beam search (sum of log-probabilities, no length penalty).

    Keeps `num_beams` hypotheses per row; the cache is stored per hypothesis
    `(B * num_beams, ...)` and reordered with a gather when beams change.
    A finished hypothesis is extended only by `pad_token_id` at no cost.
    Returns the best `(B, max_length)` sequences (and their scores).
    `attention_mask`: as `greedy_search`.
    """
    prompt_ids, encoder_ids, stops = _check(model, max_length, prompt_ids, encoder_ids,
                                            stop_token_ids)
    restore = None
    if attention_mask is not None:
        prompt_ids, restore = _left_padded(prompt_ids, attention_mask, max_length, pad_token_id)
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"`num_beams` must be a positive int. Received: num_beams={num_beams!r}")
    k = num_beams

    def loop(prompt_ids, encoder_ids):
        from keras_attn.generation import cache as cache_lib

        # The static batch size when known: a dynamic one would turn the loop
        # variables' static shapes into None after one iteration.
        batch = prompt_ids.shape[0] if prompt_ids.shape[0] is not None else tf.shape(prompt_ids)[0]
        tiled = tf.repeat(tf.cast(prompt_ids, tf.int32), k, axis=0)
        enc = None if encoder_ids is None else tf.repeat(encoder_ids, k, axis=0)
        tokens, prompt_mask, start = _buffers(tiled, max_length, pad_token_id)
        cache, kwargs, start = _prefill(model, tiled, max_length, enc, start)
        stop_ids = tf.constant(stops or (-1,), tf.int32)
        first = tf.one_hot(tf.zeros((batch,), tf.int32), k, on_value=0.0, off_value=_NEG)
        scores = tf.reshape(first, (-1,))
        done = tf.zeros((batch * k,), tf.bool)

        def cond(index, tokens, cache, done, scores):
            return tf.logical_and(index < max_length, tf.logical_not(tf.reduce_all(done)))

        def body(index, tokens, cache, done, scores):
            previous = _column(tokens, index - 1)[:, None]
            logits, cache = model.call_with_cache(previous, cache, index - 1, **kwargs)
            log_probs = tf.nn.log_softmax(tf.cast(logits[:, 0, :], tf.float32), axis=-1)
            vocab = tf.shape(log_probs)[1]
            in_prompt = _column(prompt_mask, index)
            forced = tf.where(in_prompt, _column(tokens, index), pad_token_id)
            only = tf.one_hot(forced, vocab, on_value=0.0, off_value=_NEG)
            log_probs = tf.where((in_prompt | done)[:, None], only, log_probs)
            total = tf.reshape(scores[:, None] + log_probs, (batch, k * vocab))
            top_scores, top_index = tf.math.top_k(total, k=k)
            source = tf.reshape(top_index // vocab + tf.range(batch)[:, None] * k, (-1,))
            chosen = tf.reshape(top_index % vocab, (-1,))
            tokens = tf.gather(tokens, source)
            cache = cache_lib.gather_batch(cache, source)
            done = tf.gather(done, source)
            in_prompt = tf.gather(in_prompt, source)
            stopped = tf.reduce_any(tf.equal(chosen[:, None], stop_ids[None, :]), axis=1)
            done = tf.logical_or(done, tf.logical_and(tf.logical_not(in_prompt), stopped))
            tokens = _write_column(tokens, index, chosen)
            return index + 1, tokens, cache, done, tf.reshape(top_scores, (-1,))

        _, tokens, _, _, scores = tf.while_loop(cond, body, (start, tokens, cache, done, scores))
        best = tf.range(batch) * k  # top_k sorts, so beam 0 is the best
        return tf.gather(tokens, best), tf.gather(scores, best)

    tokens, scores = _run(model, ("beam", max_length, stops, pad_token_id, k), loop, prompt_ids,
                          encoder_ids, jit_compile)
    tokens = tokens if restore is None else restore(tokens)
    return (tokens, scores) if return_scores else tokens
