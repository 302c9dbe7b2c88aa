"""Tokenizer files for models trained on keras_attn's own vocabularies.

The LLM runtimes (ONNX Runtime GenAI, LiteRT-LM) read Hugging Face
`tokenizer.json` files, and ONNX Runtime GenAI's tokenizer implements BPE,
WordPiece and Unigram models, not a plain character or word table. A
character vocabulary (the dates data, `keras_attn.data.dates`) is written as a
GPT-2-style byte-level BPE whose tokens are exactly the characters: one token
per ASCII character, and for a character of several UTF-8 bytes (`é`) the
merges that join its bytes, so every character of the vocabulary is one token
with the id the model was trained with.

Needs the `tokenizers` package (installed with `transformers`).
"""


def _bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table (as `tokenizers`' ByteLevel)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def character_tokenizer(characters, special_tokens=("<pad>", "<eos>")):
    """A `tokenizers.Tokenizer` whose ids are `special_tokens` then `characters`.

    Args:
        characters: the model's character vocabulary, in id order after the
            special tokens (a string or a sequence of one-character strings,
            no repeats).
        special_tokens: tokens with the first ids (e.g. padding 0, end 1).

    Returns:
        A byte-level BPE `tokenizers.Tokenizer`: `encode(text).ids` gives one
        id per character; `decode` inverts it. Characters of several UTF-8
        bytes get helper tokens for their bytes, with ids after the
        vocabulary, which text made of `characters` never produces.

    Example:

        tok = character_tokenizer("abc ")
        tok.encode("cab a").ids          # [4, 2, 3, 5, 2]
        export_onnx_genai(lm, folder, max_length=32, tokenizer=tok)
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    chars = list(characters)
    if any(not isinstance(c, str) or len(c) != 1 for c in chars):
        raise ValueError(
            "`characters` must be single characters. Received: "
            f"{[c for c in chars if not isinstance(c, str) or len(c) != 1][:5]}"
        )
    if len(set(chars)) != len(chars) or set(chars) & set(special_tokens):
        raise ValueError(
            "`characters` must not repeat, nor repeat a special token. Received: "
            f"characters={''.join(chars)!r}, special_tokens={tuple(special_tokens)}"
        )
    table = _bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(special_tokens)}
    symbols = ["".join(table[b] for b in c.encode("utf-8")) for c in chars]
    for symbol in symbols:
        vocab[symbol] = len(vocab)
    merges = []
    for symbol in symbols:
        # Join a multi-byte character left to right: helper tokens for its
        # prefixes (ids after the vocabulary), the last merge gives its own id.
        for end in range(2, len(symbol) + 1):
            left, right = symbol[: end - 1], symbol[end - 1]
            for part in (left, right):
                vocab.setdefault(part, len(vocab))
            merges.append((left, right))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    return tok
