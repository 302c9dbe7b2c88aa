"""Causal-LM fine-tuning data: texts or (prompt, response) pairs -> `tf.data`.

`causal_lm_arrays` tokenises with the model's own tokenizer (a
`tokenizers.Tokenizer`, a `transformers` tokenizer, or anything whose
`encode(text)` gives ids), ends every document with EOS, and lays the
documents out in rows of `sequence_length` tokens: packed one after another
(`packing=True`) or one document per row, padded. Each row is
`(token_ids, targets, sample_weights)`: the targets are the ids shifted left
by one, and a target's weight is 1 only where it is a token the model should
learn to produce (a text's tokens, a response's tokens and its EOS), 0 on
prompts, padding and the first token of a document (in a packed row that
target would be predicted from the previous document). `causal_lm_dataset`
batches and prefetches them for `DecoderOnlyLM.fit` compiled with
`SparseCategoricalCrossentropy(from_logits=True)`, or for
`keras_attn.training.Trainer`.

Packed documents share their row's causal attention: `DecoderOnlyLM` takes
no document (segment) mask, so a token attends to the earlier documents of
its row, and positions run on across them (as GPT-2/nanoGPT pretraining
does). What the weights guarantee is that no loss term predicts a token of
one document from another: the first target of every document is weighted
out. Use `packing=False` where that attention leakage matters (short
prompt/response pairs, where packing saves little anyway).
"""

import os

import numpy as np
import tensorflow as tf

from keras_attn import checks
from keras_attn.data.pipelines import AUTOTUNE


def _check_examples(examples):
    """`(kind, examples)`: `"texts"` for strings, `"pairs"` for (prompt, response)."""
    if not isinstance(examples, (list, tuple)) or not examples:
        raise ValueError(
            "Received an invalid value for argument `examples`, expected a non-empty list of "
            "strings or of (prompt, response) string pairs. Received: "
            f"examples={examples!r:.200}"
        )
    if all(isinstance(e, str) for e in examples):
        return "texts", list(examples)
    for i, example in enumerate(examples):
        if not (isinstance(example, (list, tuple)) and len(example) == 2
                and all(isinstance(part, str) for part in example)):
            raise ValueError(
                f"Received an invalid value for argument `examples[{i}]`, expected a "
                "(prompt, response) pair of strings like every other entry (or every entry a "
                f"string). Received: examples[{i}]={example!r:.200}"
            )
    return "pairs", [tuple(e) for e in examples]


def _load_tokenizer(tokenizer):
    """A tokenizer object; a folder (a converted model's, `save_pretrained`'s)
    is read with `transformers` (its chat template and EOS come with it), or
    as a bare `tokenizer.json` with `tokenizers` when `transformers` is absent."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    folder = os.fspath(tokenizer)
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ValueError(
            "Received an invalid value for argument `tokenizer`: a path must be a folder "
            f"holding tokenizer.json. Received: tokenizer={folder!r}"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        import tokenizers

        return tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _encode(tokenizer, text, add_special_tokens):
    """Token ids of `text` as a list of ints.

    `tokenizers.Tokenizer.encode` and `transformers` tokenizers both take
    `add_special_tokens` (a `tokenizers` result holds its ids in `.ids`); a
    plain `encode(text)` (e.g. `keras_attn.data.CharTokenizer`) has no
    special tokens to add.
    """
    if hasattr(tokenizer, "apply_chat_template") or hasattr(tokenizer, "encode_batch"):
        out = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        out = tokenizer.encode(text)
    return [int(i) for i in getattr(out, "ids", out)]


def _chat_parts(tokenizer, prompt, response):
    """`(prompt_text, response_text)` rendered by the tokenizer's chat template.

    The response is what the full conversation adds after the prompt with
    the generation prompt, so its weighted tokens include the template's
    end-of-turn marker: the model learns to close its turn as the template
    does.
    """
    user = {"role": "user", "content": prompt}
    prompt_text = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": response}], tokenize=False
    )
    if not full.startswith(prompt_text):
        raise ValueError(
            "The tokenizer's chat template renders the conversation without the generation "
            "prompt as its prefix, so the response tokens cannot be told apart; build the pairs "
            "with use_chat_template=False from text you render yourself. Received: prompt "
            f"rendered as {prompt_text!r:.200}, conversation as {full!r:.200}"
        )
    return prompt_text, full[len(prompt_text):]


def _documents(kind, examples, tokenizer, eos_token_id, use_chat_template):
    """`[(ids, learn)]`: each document's tokens and whether each is a target to learn."""
    documents = []
    for example in examples:
        if kind == "texts":
            ids = _encode(tokenizer, example, add_special_tokens=True)
            learn = [True] * len(ids)
        else:
            prompt, response = example
            if use_chat_template:
                # The rendered template holds its special tokens as text.
                prompt, response = _chat_parts(tokenizer, prompt, response)
            prompt_ids = _encode(tokenizer, prompt, add_special_tokens=not use_chat_template)
            response_ids = _encode(tokenizer, response, add_special_tokens=False)
            ids = prompt_ids + response_ids
            learn = [False] * len(prompt_ids) + [True] * len(response_ids)
        if not use_chat_template and (not ids or ids[-1] != eos_token_id):
            ids.append(eos_token_id)
            learn.append(True)
        if learn:  # A document's first token has nothing of its own document before it.
            learn[0] = False
        documents.append((ids, learn))
    return documents


def _rows(stream, weights, sequence_length, pad_token_id):
    """`(inputs, targets, weights)` rows over one token stream: row `r` reads
    `stream[r * L : r * L + L]` and targets the next token of each, so every
    token but the first is a target exactly once; the last row is padded."""
    length = sequence_length
    num_rows = max(1, -(-(len(stream) - 1) // length))
    size = num_rows * length + 1
    ids = np.full(size, pad_token_id, np.int32)
    ids[: len(stream)] = stream
    learn = np.zeros(size, np.float32)
    learn[: len(weights)] = weights
    inputs = ids[:-1].reshape(num_rows, length)
    targets = ids[1:].reshape(num_rows, length)
    return inputs, targets, learn[1:].reshape(num_rows, length)


def causal_lm_arrays(
    examples,
    tokenizer,
    sequence_length,
    *,
    packing=True,
    use_chat_template=False,
    eos_token_id=None,
    pad_token_id=0,
):
    """NumPy `(token_ids, targets, sample_weights)`, each `(rows, sequence_length)`.

    Args:
        examples: a non-empty list of texts (every token is learned) or of
            `(prompt, response)` string pairs (only the response is).
        tokenizer: the model's tokenizer: a `tokenizers.Tokenizer`
            (e.g. `keras_attn.runtimes.tokenizers.character_tokenizer`), a
            `transformers` tokenizer, an object whose `encode(text)` gives
            ids, or the path of a folder holding `tokenizer.json` (the
            Hugging Face folder a model was converted from), read with
            `transformers.AutoTokenizer` (so with its chat template). A text or prompt gets the tokenizer's own special tokens
            (Llama's BOS); a response gets none (it continues the prompt).
            Prompt and response are tokenised separately, so no token spans
            their boundary.
        sequence_length: tokens per row (the model's input length), >= 2.
        packing: True: documents follow each other in a stream cut into
            rows (a document may continue in the next row, without its
            start in view); False: one document per row, right-padded, a
            document longer than `sequence_length + 1` tokens truncated.
        use_chat_template: pairs only: render each pair with the
            tokenizer's chat template (a `transformers` tokenizer that has
            one) as a user turn and the assistant's answer; the answer's
            tokens up to the template's end-of-turn marker are learned, and
            no EOS is appended (the template ends the turn).
        eos_token_id: appended to each document; None: the tokenizer's
            `eos_token_id`.
        pad_token_id: the id that fills rows. Padding is at the end of a
            row, which causal attention never lets a real token see, and its
            weights are 0, so its value changes no weighted loss.

    Returns:
        `token_ids` int32, `targets` int32 (`token_ids` shifted left by
        one), `sample_weights` float32: 1 where the target is learned, 0 on
        prompts, padding and each document's first token.
    """
    kind, examples = _check_examples(examples)
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, (int, np.integer)) \
            or sequence_length < 2:
        raise ValueError(
            "Received an invalid value for argument `sequence_length`, expected an integer >= 2 "
            "(a row's input tokens, each with the next token as its target). "
            f"Received: sequence_length={sequence_length!r}"
        )
    tokenizer = _load_tokenizer(tokenizer)
    if not hasattr(tokenizer, "encode"):
        raise TypeError(
            "Received an invalid value for argument `tokenizer`, expected a "
            "`tokenizers.Tokenizer`, a `transformers` tokenizer or an object with "
            f"`encode(text)`. Received: tokenizer of type {type(tokenizer).__name__}"
        )
    checks.check_bool("packing", packing)
    checks.check_bool("use_chat_template", use_chat_template)
    if use_chat_template:
        if kind == "texts":
            raise ValueError(
                "`use_chat_template=True` needs (prompt, response) pairs in `examples`; "
                "plain texts are used as they are. Received: a list of strings"
            )
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "Received use_chat_template=True, but the tokenizer has no chat template "
                f"(`tokenizer.chat_template` is unset on {type(tokenizer).__name__})."
            )
    if eos_token_id is None and not use_chat_template:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            raise ValueError(
                "Received eos_token_id=None and the tokenizer has no `eos_token_id`: pass "
                "the id that ends a document, e.g. eos_token_id=tokenizer.token_to_id('<eos>')."
            )
    documents = _documents(kind, examples, tokenizer, eos_token_id, use_chat_template)
    if packing:
        stream = [i for ids, _ in documents for i in ids]
        learn = [w for _, weights in documents for w in weights]
        return _rows(stream, learn, sequence_length, pad_token_id)
    rows = [_rows(ids[: sequence_length + 1], learn[: sequence_length + 1], sequence_length,
                  pad_token_id) for ids, learn in documents]
    return tuple(np.concatenate(parts) for parts in zip(*rows))


def causal_lm_dataset(
    examples,
    tokenizer,
    sequence_length,
    batch_size,
    *,
    packing=True,
    use_chat_template=False,
    eos_token_id=None,
    pad_token_id=0,
    shuffle=False,
    seed=0,
    repeat=False,
    drop_remainder=False,
):
    """Batches of `(token_ids, targets, sample_weights)` for a causal LM's `fit`.

    The rows of `causal_lm_arrays` (see it for the arguments it shares), in
    a `tf.data.Dataset` of `(B, sequence_length)` batches, prefetched; `fit`
    reads the third element as per-token sample weights, so with
    `SparseCategoricalCrossentropy(from_logits=True)` only the learned
    tokens contribute to the loss. `keras_attn.training.Trainer` takes the
    same triples (with `repeat=True`: it skips the batches already trained
    on when it resumes from a checkpoint).

    Args:
        batch_size: rows per batch.
        shuffle: shuffle the rows differently each epoch, in an order that
            depends on `seed` and the epoch only (the same on every run,
            whatever TensorFlow's global seed).
        repeat: repeat forever (for `Trainer`, or `fit` with `steps_per_epoch`).
        drop_remainder: drop a last smaller batch (one shape for XLA).

    Example:

        tok = character_tokenizer("abc=")          # ids: <pad> 0, <eos> 1, then a, b, c, =
        ds = causal_lm_dataset([("ab=", "ba")], tok, sequence_length=8, batch_size=4,
                               eos_token_id=1)
        lm.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        lm.fit(ds, epochs=3)
    """
    checks.check_batch_size(batch_size)
    for name, value in (("shuffle", shuffle), ("repeat", repeat),
                        ("drop_remainder", drop_remainder)):
        checks.check_bool(name, value)
    arrays = causal_lm_arrays(
        examples, tokenizer, sequence_length, packing=packing,
        use_chat_template=use_chat_template, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    num_rows = len(arrays[0])
    epochs = tf.data.Dataset.counter() if repeat else tf.data.Dataset.range(1)
    if shuffle:
        # A stateless permutation per epoch, a function of (seed, epoch) only:
        # `Dataset.shuffle` would also read TensorFlow's global seed, and a
        # run resumed under another global seed would see another order.
        def epoch_order(epoch):
            key = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])
            return tf.random.experimental.stateless_shuffle(tf.range(num_rows), seed=key)
    else:
        def epoch_order(epoch):
            return tf.range(num_rows)
    rows = tuple(tf.constant(a) for a in arrays)
    ds = epochs.flat_map(lambda e: tf.data.Dataset.from_tensor_slices(epoch_order(e)))
    ds = ds.map(lambda i: tuple(tf.gather(a, i) for a in rows), num_parallel_calls=AUTOTUNE,
                deterministic=True)
    # `flat_map` hides the length; `fit` needs it to end an epoch without
    # running the iterator dry (and warning that the input ran out).
    ds = ds.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY if repeat else num_rows))
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(AUTOTUNE)
