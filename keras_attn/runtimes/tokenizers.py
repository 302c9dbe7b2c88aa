"""Tokenizer files for models trained on keras_attn's own vocabularies.

The LLM runtimes (ONNX Runtime GenAI, LiteRT-LM) read Hugging Face
`tokenizer.json` files, and ONNX Runtime GenAI's tokenizer implements BPE,
WordPiece and Unigram models, not a plain character or word table. A
character vocabulary (the dates data, `keras_attn.data.dates`) is written as a
GPT-2-style byte-level BPE whose tokens are exactly the characters: one token
per ASCII character, and for a character of several UTF-8 bytes (`é`) the
merges that join its bytes, so every character of the vocabulary is one token
with the id the model was trained with.

`character_tokenizer` and `word_tokenizer` need the `tokenizers` package
(installed with `transformers`); `write_tokenizer` puts a tokenizer's files
into a runtime's folder.
"""

import json
import os
import shutil


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


def bpe_tokenizer(texts, vocab_size, special_tokens=("<pad>", "<eos>")):
    """A byte-level BPE `tokenizers.Tokenizer` (GPT-2's kind) trained on `texts`.

    Args:
        texts: an iterable of strings to learn the merges from.
        vocab_size: the vocabulary size to train to (special tokens and the
            256 byte tokens included).
        special_tokens: tokens with the first ids (e.g. padding 0, end 1).

    Returns:
        The trained tokenizer; every text is encodable (the byte alphabet is
        always in the vocabulary) and `decode` inverts `encode`.

    Example:

        tok = bpe_tokenizer(["the cat sat", "the dog ran"] * 50, vocab_size=300)
        tok.decode(tok.encode("the cat ran").ids)   # "the cat ran"
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


# TextVectorization's default `standardize="lower_and_strip_punctuation"`.
_PUNCTUATION = r'[!"#$%&()\*\+,\-\./:;<=>?@\[\\\]^_`{|}~\']'


def word_tokenizer(vocabulary, *, unk_token="[UNK]", pad_token="[PAD]",
                   standardize="lower_and_strip_punctuation"):
    """A `tokenizers.Tokenizer` for a word vocabulary (e.g. `TextVectorization`'s).

    A word-level table is not a model LiteRT-LM's tokenizer takes, so the
    words become a WordPiece vocabulary with no `##` pieces: a word in the vocabulary is one
    token with its id, any other word is `unk_token` (WordPiece gives up on
    a word whose pieces are not all in the vocabulary), as in
    TextVectorization. Words are split on whitespace. ONNX Runtime GenAI has
    no WordPiece tokenizer class: `export_onnx_genai` refuses this one.

    Args:
        vocabulary: the words in id order, e.g.
            `TextVectorization.get_vocabulary()`; its empty string (id 0,
            padding) is named `pad_token`. Must contain `unk_token`.
        unk_token: the out-of-vocabulary token (TextVectorization's `[UNK]`).
        pad_token: the name given to the empty string.
        standardize: "lower_and_strip_punctuation" (TextVectorization's
            default), "lower", "strip_punctuation" or None.

    Returns:
        A WordPiece `tokenizers.Tokenizer`; `decode` joins words with spaces.

    Example:

        vectorize = keras.layers.TextVectorization(max_tokens=1000)
        vectorize.adapt(texts)
        tok = word_tokenizer(vectorize.get_vocabulary())
        export_litertlm(lm, "lm.litertlm", tokenizer=tok, max_length=64)
    """
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    words = [pad_token if w == "" else w for w in vocabulary]
    if any(not isinstance(w, str) for w in words):
        raise TypeError(f"`vocabulary` must hold strings. Received: {list(vocabulary)[:5]}")
    if len(set(words)) != len(words) or any(" " in w or not w for w in words):
        raise ValueError(
            "`vocabulary` must hold distinct words without spaces (the empty string "
            f"becomes {pad_token!r}). Received: {list(vocabulary)[:10]}...")
    if unk_token not in words:
        raise ValueError(f"`vocabulary` must contain unk_token={unk_token!r}.")
    steps = {
        "lower_and_strip_punctuation": [normalizers.Lowercase(),
                                        normalizers.Replace(tokenizers.Regex(_PUNCTUATION), "")],
        "lower": [normalizers.Lowercase()],
        "strip_punctuation": [normalizers.Replace(tokenizers.Regex(_PUNCTUATION), "")],
        None: [],
    }
    if standardize not in steps:
        raise ValueError(f"`standardize` must be one of {list(steps)}. Received: {standardize!r}")
    tok = tokenizers.Tokenizer(models.WordPiece(
        {w: i for i, w in enumerate(words)}, unk_token=unk_token, max_input_chars_per_word=200))
    tok.normalizer = normalizers.Sequence(steps[standardize])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    specials = [w for w in (pad_token, unk_token) if w in words]
    tok.add_special_tokens(specials)
    return tok


def write_tokenizer(tokenizer, folder):
    """`tokenizer.json` (+ `tokenizer_config.json`) from a path, a
    `tokenizers.Tokenizer` or a `transformers` fast tokenizer."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        source = os.path.dirname(path) if os.path.isfile(path) else path
        if not os.path.isfile(os.path.join(source, "tokenizer.json")) and not path.endswith(".json"):
            raise ValueError(
                "`tokenizer` must name a tokenizer.json file or a folder holding one. "
                f"Received: tokenizer={path!r}"
            )
        shutil.copy(path if os.path.isfile(path) else os.path.join(source, "tokenizer.json"),
                    os.path.join(folder, "tokenizer.json"))
        config = os.path.join(source, "tokenizer_config.json")
        if os.path.isfile(config):
            shutil.copy(config, os.path.join(folder, "tokenizer_config.json"))
    elif hasattr(tokenizer, "save_pretrained"):  # transformers
        tokenizer.save_pretrained(folder)
    elif hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write(tokenizer.to_str())
    else:
        raise TypeError(
            "`tokenizer` must be a tokenizer.json path, a `tokenizers.Tokenizer` or a "
            f"transformers tokenizer. Received: {type(tokenizer).__name__}"
        )
    config_path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        # GenAI's tokenizer picks its algorithm from the class name; a
        # byte-level BPE tokenizer.json is GPT-2's.
        with open(config_path, "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer"}, f)




def tokenizer_model_type(folder):
    """The model type (`"BPE"`, `"WordPiece"`, ...) of `folder`'s `tokenizer.json`,
    or None without one."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("model", {}).get("type")
