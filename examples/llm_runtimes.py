"""A converted language model in the runtimes apps ship LLMs with.

`keras_attn.convert.from_huggingface` turns a Llama-family `*ForCausalLM` (or a
GPT-2) into a `keras_attn.generation.DecoderOnlyLM`; this example then

1. generates from a text prompt in Keras (`greedy_search`),
2. writes an ONNX Runtime GenAI folder (`export_onnx_genai`: `model.onnx`,
   `genai_config.json`, the tokenizer) and generates from the same text with
   `onnxruntime_genai` (its own loop and tokenizer),
3. writes a LiteRT-LM bundle (`export_litertlm`: the TFLite prefill/decode
   model, `LlmMetadata` and the tokenizer in one `.litertlm` file) and
   generates with `litert_lm.Engine` (when `litert-lm-api` is installed),

and prints each runtime's text and whether its tokens equal Keras's.

Nothing is downloaded: `--hf-dir` is a directory written by `save_pretrained`
(model and `tokenizer.json`); without it, a tiny random-init Llama and a
byte-level BPE tokenizer trained here on generated text stand in (the text is
then gibberish; the token agreement is what the run checks).

    python examples/llm_runtimes.py
    python examples/llm_runtimes.py --hf-dir ./my-llama --prompt "The capital of France is"

Exit status 0 when every runtime that ran gave Keras's tokens.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def tiny_llama(folder):
    """A random-init Llama and a byte-level BPE tokenizer, saved like a checkpoint."""
    import numpy as np
    import torch
    import transformers

    from keras_attn.runtimes import bpe_tokenizer

    rng = np.random.default_rng(0)
    words = "the a cat dog sat ran on in under mat box red blue small big and then".split()
    corpus = [" ".join(rng.choice(words, 8)) for _ in range(500)]
    tok = bpe_tokenizer(corpus, vocab_size=400)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        initializer_range=0.2, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                         pad_token="<pad>").save_pretrained(folder)


def generate_genai(folder, text, max_length):
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(folder)
    tokenizer = og.Tokenizer(model)
    prompt = np.asarray(tokenizer.encode(text), np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt[None])
    while not generator.is_done():
        generator.generate_next_token()
    new = np.asarray(generator.get_sequence(0))[len(prompt):]
    return [int(t) for t in new], tokenizer.decode(new)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", help="a save_pretrained directory with tokenizer.json")
    parser.add_argument("--prompt", default="the red cat sat on the")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--output-dir", default="outputs/llm_runtimes")
    args = parser.parse_args(argv)

    import numpy as np
    import transformers

    from keras_attn import runtimes
    from keras_attn.convert import from_huggingface
    from keras_attn.generation import greedy_search

    os.makedirs(args.output_dir, exist_ok=True)
    hf_dir = args.hf_dir or os.path.join(args.output_dir, "tiny_llama")
    if args.hf_dir is None:
        tiny_llama(hf_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    lm = from_huggingface(hf_dir)
    eos = tokenizer.eos_token_id
    prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    keras_ids = np.asarray(greedy_search(lm, np.array([prompt], np.int32), args.max_length,
                                         stop_token_ids=() if eos is None else (eos,)))[0]
    keras_new = [int(t) for t in keras_ids[len(prompt):]]
    if eos is not None and eos in keras_new:
        keras_new = keras_new[:keras_new.index(eos)]
    print(f"prompt: {args.prompt!r} -> {len(prompt)} tokens")
    print(f"keras:        {tokenizer.decode(keras_new)!r}")
    summary = {"prompt": args.prompt, "keras": keras_new, "runtimes": {}}

    genai_dir = os.path.join(args.output_dir, "onnx_genai")
    runtimes.export_onnx_genai(lm, genai_dir, max_length=args.max_length, tokenizer=hf_dir,
                               eos_token_id=eos)
    tokens, text = generate_genai(genai_dir, args.prompt, args.max_length)
    summary["runtimes"]["onnxruntime_genai"] = {"tokens": tokens, "equal": tokens == keras_new}
    print(f"ORT GenAI:    {text!r}  tokens equal to Keras: {tokens == keras_new}")

    try:
        import litert_lm
    except ImportError:
        litert_lm = None
    if litert_lm is None:
        print("LiteRT-LM:    skipped (litert-lm-api is not installed: pip install "
              "'keras-attn[llm-runtimes]')")
    else:
        from keras_attn.runtimes import litertlm

        bundle = os.path.join(args.output_dir, "model.litertlm")
        # Keras was given the prompt without a start token: the bundle adds none.
        runtimes.export_litertlm(lm, bundle, tokenizer=hf_dir, max_length=args.max_length,
                                 bos_token_id=None,
                                 stop_token_ids=[eos] if eos is not None else None)
        engine = litert_lm.Engine(bundle, backend=litert_lm.Backend.CPU())
        try:
            text = litertlm.generate(bundle, args.prompt, engine=engine)
            # LiteRT-LM answers text: equal to the detokenized Keras tokens
            # (through the bundle's own tokenizer) means the same tokens.
            equal = text == engine.detokenize(keras_new)
        finally:
            engine.close()
        summary["runtimes"]["litert_lm"] = {"text": text, "equal": equal}
        print(f"LiteRT-LM:    {text!r}  tokens equal to Keras: {equal}")

    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if all(r["equal"] for r in summary["runtimes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
