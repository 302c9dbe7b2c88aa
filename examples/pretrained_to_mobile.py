"""A pretrained BERT classifier and GPT-2 LM onto keras_attn, fine-tuned, on a phone.

1. **BERT.** `keras_attn.convert.from_huggingface` turns a
   `BertForSequenceClassification` (from `--bert-dir`, a directory written by
   `save_pretrained`, or else a tiny random-init config) into a Keras model
   of keras_attn layers, checks its logits against Hugging Face, fine-tunes
   it a few steps on the project's offline review data
   (`keras_attn.data.text.generate_reviews`), and exports it to TFLite
   (builtin ops only) and ONNX, each verified against Keras.
2. **GPT-2.** The same call turns a `GPT2LMHeadModel` (`--gpt2-dir` or a tiny
   random config) into a `keras_attn.generation.DecoderOnlyLM`. Its cached
   greedy decoding (`greedy_search`) is compared with Hugging Face
   `generate(do_sample=False)`; it is exported as TFLite and ONNX
   `prefill`/`decode` signatures (`keras_attn.runtimes.signatures`), decoded by
   a NumPy loop over each runtime, and the token agreement with Hugging Face
   is printed.

Nothing is downloaded: without directories the models are random-init (the
numbers then only check the conversion, not language skills).

    python examples/pretrained_to_mobile.py
    python examples/pretrained_to_mobile.py --bert-dir ./my-bert --gpt2-dir ./my-gpt2

`--output-dir` receives `bert_classifier.tflite`, `bert_classifier.onnx`,
`gpt2_prefill_decode.tflite`, `gpt2_onnx/{prefill,decode}.onnx` and
`pretrained_summary.json`. Exit status 0 when every runtime's tokens equal
Hugging Face's.
"""

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def numpy_greedy(prefill, decode, prompts, max_length):
    """Greedy decoding over exported `prefill`/`decode` signatures (dicts in
    and out, NumPy arrays): the loop an app runs next to a TFLite or ONNX
    runtime. Prefill the whole prompt, then feed one token at a time."""
    import numpy as np

    batch, length = prompts.shape
    tokens = np.zeros((batch, max_length), np.int32)
    tokens[:, :length] = prompts
    out = prefill(token_ids=prompts.astype(np.int32))
    tokens[:, length] = np.argmax(out["logits"][:, -1], axis=-1)
    cache = out["cache"]
    for i in range(length + 1, max_length):
        out = decode(token_ids=tokens[:, i - 1 : i], cache=cache, index=np.array(i - 1, np.int32))
        cache = out["cache"]
        tokens[:, i] = np.argmax(out["logits"][:, 0], axis=-1)
    return tokens


def tflite_runners(path):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    return interpreter.get_signature_runner("prefill"), interpreter.get_signature_runner("decode")


def onnx_runners(paths):
    # The session wrapper of the seq2seq mobile example (same directory).
    from translate_dates_mobile import onnx_runner

    return onnx_runner(paths["prefill"]), onnx_runner(paths["decode"])


def _parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bert-dir", default=None, help="local BertForSequenceClassification (save_pretrained)")
    parser.add_argument("--gpt2-dir", default=None, help="local GPT2LMHeadModel (save_pretrained)")
    parser.add_argument("--num-train", type=int, default=2000, help="review examples to fine-tune on")
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40, help="fine-tuning steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--prompt-length", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=24, help="GPT-2 tokens incl. the prompt")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="keras_attn_outputs/pretrained")
    parser.add_argument("--verbose", type=int, default=0, help="Keras fit verbosity")
    return parser.parse_args(argv)


def _tokenizer(directory):
    """The checkpoint's tokenizer when the directory has one, else None."""
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")
    if directory is None or not any(os.path.exists(os.path.join(directory, f)) for f in files):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError):
        return None


def _encode_reviews(texts, tokenizer, length, vocab):
    """`(ids, attention_mask)`: the checkpoint's tokenizer, or a word-level
    vocabulary built from the data (ids from 3; 0 = padding)."""
    import numpy as np

    if tokenizer is not None:
        enc = tokenizer(list(texts), padding="max_length", truncation=True, max_length=length,
                        return_tensors="np")
        return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)
    ids = np.zeros((len(texts), length), np.int32)
    for row, text in enumerate(texts):
        words = [vocab.setdefault(w, len(vocab) + 3) for w in re.findall(r"[a-z']+", text.lower())]
        ids[row, : len(words[:length])] = words[:length]
    return ids, (ids != 0).astype(np.int32)


def bert_part(args, summary):
    import keras
    import numpy as np
    import torch
    import transformers

    from keras_attn import export as kx
    from keras_attn.convert import from_huggingface
    from keras_attn.data.text import generate_reviews

    train = generate_reviews(args.num_train, seed=args.seed)
    test = generate_reviews(args.num_test, seed=args.seed + 1)
    tokenizer = _tokenizer(args.bert_dir)
    vocab = {}
    x_train, m_train = _encode_reviews([t for t, _ in train], tokenizer, args.sequence_length, vocab)
    x_test, m_test = _encode_reviews([t for t, _ in test], tokenizer, args.sequence_length, vocab)
    y_train = np.array([y for _, y in train], np.int32)
    y_test = np.array([y for _, y in test], np.int32)

    if args.bert_dir:
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(
            args.bert_dir, local_files_only=True
        ).eval()
        source = args.bert_dir
    else:
        torch.manual_seed(args.seed)
        config = transformers.BertConfig(
            vocab_size=max(len(vocab) + 3, 64), hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
            num_labels=2,
        )
        hf = transformers.BertForSequenceClassification(config).eval()
        source = "random-init BertConfig (hidden 64, 2 layers)"
    if hf.config.num_labels != 2:
        raise SystemExit(f"--bert-dir must be a 2-label classifier; it has {hf.config.num_labels} labels")
    vocab_size = hf.config.vocab_size
    if int(x_train.max()) >= vocab_size:
        raise SystemExit(f"The data's ids exceed the checkpoint's vocabulary ({vocab_size}); give it a tokenizer.")
    types_train, types_test = np.zeros_like(x_train), np.zeros_like(x_test)
    model = from_huggingface(hf)
    names = [i.name for i in model.inputs]

    def feed(ids, mask, types):
        values = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return [values[n] for n in names]

    with torch.no_grad():
        want = hf(input_ids=torch.tensor(x_test[:16], dtype=torch.long),
                  attention_mask=torch.tensor(m_test[:16])).logits.numpy()
    got = np.asarray(model(feed(x_test[:16], m_test[:16], types_test[:16])))
    parity = float(np.max(np.abs(got - want)))
    print(f"BERT from {source}: {model.count_params():,} parameters; "
          f"logits vs Hugging Face max |diff| {parity:.2e}")

    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    _, before = model.evaluate(feed(x_test, m_test, types_test), y_test, verbose=0)
    steps_per_epoch = max(1, len(x_train) // args.batch_size)
    epochs = max(1, -(-args.steps // steps_per_epoch))
    began = time.perf_counter()
    model.fit(feed(x_train, m_train, types_train), y_train, batch_size=args.batch_size,
              epochs=epochs, steps_per_epoch=min(args.steps, steps_per_epoch),
              verbose=args.verbose)
    _, after = model.evaluate(feed(x_test, m_test, types_test), y_test, verbose=0)
    print(f"fine-tuned {args.steps} steps in {time.perf_counter() - began:.0f} s: "
          f"test accuracy {before:.3f} -> {after:.3f}")

    tfl = kx.export_tflite(model, os.path.join(args.output_dir, "bert_classifier.tflite"))
    onx = kx.export_onnx(model, os.path.join(args.output_dir, "bert_classifier.onnx"))
    for report in (tfl, onx):
        print(f"  {report.path}: {report.size_bytes / 1024:.0f} KiB, max |diff| vs Keras "
              f"{report.max_abs_error:.2e}")
    summary.update(bert_hf_parity=parity, bert_accuracy_before=float(before),
                   bert_accuracy_after=float(after), bert_tflite_error=tfl.max_abs_error,
                   bert_onnx_error=onx.max_abs_error)
    return parity <= 1e-4


def gpt2_part(args, summary):
    import numpy as np
    import torch
    import transformers

    from keras_attn.convert import from_huggingface
    from keras_attn.runtimes import signatures as gen_export
    from keras_attn.generation import greedy_search

    if args.gpt2_dir:
        hf = transformers.AutoModelForCausalLM.from_pretrained(args.gpt2_dir, local_files_only=True).eval()
        source = args.gpt2_dir
    else:
        torch.manual_seed(args.seed)
        # initializer_range 0.3: sharper attention than a fresh 0.02 init, so
        # the greedy tokens depend on the whole prompt.
        config = transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            initializer_range=0.3, bos_token_id=1, eos_token_id=2,
        )
        hf = transformers.GPT2LMHeadModel(config).eval()
        source = "random-init GPT2Config (n_embd 64, 2 layers)"
    lm = from_huggingface(hf)
    tokenizer = _tokenizer(args.gpt2_dir)
    rng = np.random.default_rng(args.seed)
    if tokenizer is not None:
        texts = ["The weather today is", "Once upon a time", "The model exports to", "Attention is"]
        enc = [tokenizer(t)["input_ids"] for t in texts[: args.num_prompts]]
        length = min(len(e) for e in enc)
        prompts = np.array([e[:length] for e in enc], np.int32)
    else:
        prompts = rng.integers(3, hf.config.vocab_size, (args.num_prompts, args.prompt_length)).astype(np.int32)
    max_length = args.max_length
    print(f"GPT-2 from {source}: {lm.count_params():,} parameters; {len(prompts)} prompts of "
          f"{prompts.shape[1]} tokens, decoding to {max_length}")

    with torch.no_grad():
        hf_tokens = hf.generate(
            torch.tensor(prompts, dtype=torch.long), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False, max_length=max_length, pad_token_id=0, eos_token_id=None,
        ).numpy()
    keras_tokens = np.asarray(greedy_search(lm, prompts, max_length=max_length))

    tflite_path = os.path.join(args.output_dir, "gpt2_prefill_decode.tflite")
    gen_export.export_tflite(lm, tflite_path, max_length=max_length, batch_size=len(prompts),
                             prompt_length=prompts.shape[1])
    tflite_tokens = numpy_greedy(*tflite_runners(tflite_path), prompts, max_length)
    onnx_paths = gen_export.export_onnx(lm, os.path.join(args.output_dir, "gpt2_onnx"), max_length=max_length)
    onnx_tokens = numpy_greedy(*onnx_runners(onnx_paths), prompts, max_length)

    ok = True
    new = slice(prompts.shape[1], max_length)
    for name, tokens in (("Keras greedy_search", keras_tokens), ("TFLite + NumPy loop", tflite_tokens),
                         ("ONNX + NumPy loop", onnx_tokens)):
        agreement = float(np.mean(tokens[:, new] == hf_tokens[:, new]))
        rows = float(np.mean(np.all(tokens == hf_tokens, axis=1)))
        print(f"  {name:20}: {agreement:.4f} of generated tokens and {rows:.4f} of sequences "
              "equal Hugging Face generate(do_sample=False)")
        summary[f"gpt2_{name.split()[0].lower()}_token_agreement"] = agreement
        ok = ok and rows == 1.0
    if tokenizer is not None:
        print("  first continuation:", repr(tokenizer.decode(tflite_tokens[0])))
    return ok


def main(argv=None):
    args = _parse(argv)
    import keras

    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    summary = {}
    ok = bert_part(args, summary)
    ok = gpt2_part(args, summary) and ok
    with open(os.path.join(args.output_dir, "pretrained_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("all runtimes agree with Hugging Face" if ok else "MISMATCH with Hugging Face")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
