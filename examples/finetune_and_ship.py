"""Fine-tune a converted decoder with LoRA, then ship the fine-tunes as adapters.

1. A base model: a Hugging Face folder (model and tokenizer). Nothing is
   downloaded: without `--hf-dir`, a small Llama-shaped model is pretrained
   here on texts about dates (each date as people write it, then in ISO and
   US form: "Tuesday, March 14, 2001. 2001-03-14. 03/14/2001.") and saved
   with `save_pretrained`, standing in for a downloaded checkpoint.
2. `keras_attn.convert.from_huggingface` converts it. The task is an
   instruction the base never saw: "<a date as people write it> ->" answered
   in one form. The base's exact match is printed beside each fine-tune's.
3. One LoRA adapter per answer form (ISO and US), with PEFT's meaning
   (`enable_lora`: rank 16 on the attention projections), trained with `model.fit` on
   `keras_attn.data.causal_lm_dataset` (the loss sees only the answers), and
   saved as PEFT folders (`save_peft_adapter`). Each is scored in Keras after
   loading it back from its folder (`from_huggingface(base, adapter=...)`).
4. Shipping, one base per runtime and one small file per fine-tune: an ONNX
   Runtime GenAI folder (`export_onnx_genai(..., adapters=True)`, more
   `.onnx_adapter` files by `save_onnx_adapter`, activated per generator)
   and a LiteRT-LM bundle (`export_litertlm(..., lora_rank=16)`, LoRA files
   by `save_litertlm_lora`, given per session); each runtime's exact match
   beside Keras's.

    python examples/finetune_and_ship.py
    python examples/finetune_and_ship.py --hf-dir ./my-llama   # skips step 1

Writes `summary.json` in `--output-dir`. Exit status 0 when every runtime
gave Keras's answers.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FORMS = {
    "iso": lambda iso: iso,
    "us": lambda iso: "{1}/{2}/{0}".format(*iso.split("-")),
}
PROMPT = "{} ->"
EOS, PAD = 1, 0


def pretrain_base(folder, train, *, epochs, hidden_size=64, num_layers=2, seed=0):
    """A Llama-shaped model and byte-level BPE tokenizer trained on date texts,
    saved as a Hugging Face folder (what `--hf-dir` would hold)."""
    import keras
    import torch
    import transformers

    from keras_attn.convert import from_huggingface, save_huggingface
    from keras_attn.data import causal_lm_dataset
    from keras_attn.runtimes import bpe_tokenizer

    texts = [f"{human}. {FORMS['iso'](iso)}. {FORMS['us'](iso)}." for human, iso in train]
    tok = bpe_tokenizer(texts, vocab_size=600)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                     pad_token="<pad>")
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden_size,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, max_position_embeddings=128)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    # Pretraining is an ordinary full fit of the converted model, written back
    # to the folder's safetensors.
    lm = from_huggingface(folder)
    lm.compile(keras.optimizers.AdamW(3e-3),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras.utils.set_random_seed(seed)
    lm.fit(causal_lm_dataset(texts, tokenizer, 64, 32, eos_token_id=EOS, shuffle=True,
                             seed=seed), epochs=epochs, verbose=2)
    save_huggingface(lm, folder)


def prompts_and_answers(pairs, form):
    return [(PROMPT.format(human), " " + FORMS[form](iso)) for human, iso in pairs]


def answer_ids(lm, tokenizer, prompts, max_new_tokens=12):
    """Greedy answers (token ids up to EOS) of a batch of prompts, in Keras."""
    import numpy as np

    from keras_attn.generation import greedy_search

    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(ids) for ids in encoded)
    ids = np.full((len(encoded), width), PAD, np.int32)
    mask = np.zeros_like(ids)
    for row, e in enumerate(encoded):  # left-padded, as `generate` takes a batch
        ids[row, width - len(e):] = e
        mask[row, width - len(e):] = 1
    out = np.asarray(greedy_search(lm, ids, width + max_new_tokens, stop_token_ids=(EOS,),
                                   pad_token_id=PAD, attention_mask=mask))
    return [until_eos(row[width:]) for row in out]


def until_eos(tokens):
    tokens = [int(t) for t in tokens]
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


def exact_match(tokenizer, answers, references):
    texts = [tokenizer.decode(a).strip() for a in answers]
    return sum(t == r.strip() for t, r in zip(texts, references)) / len(references)


def train_adapter(base_dir, tokenizer, train, form, *, rank, epochs, learning_rate, seed=0):
    import keras

    from keras_attn.convert import from_huggingface
    from keras_attn.data import causal_lm_dataset

    lm = from_huggingface(base_dir)
    keras.utils.set_random_seed(seed)
    # PEFT's LoraConfig(r=rank, target_modules=[the attention projections]):
    # LiteRT-LM's LoRA inputs exist for these only, at rank 16 or 32.
    lm.enable_lora(rank, target_names=("q_proj", "k_proj", "v_proj", "o_proj"))
    lm.compile(keras.optimizers.AdamW(learning_rate),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lm.fit(causal_lm_dataset(prompts_and_answers(train, form), tokenizer, 32, 32,
                             packing=False, eos_token_id=EOS, shuffle=True, seed=seed),
           epochs=epochs, verbose=2)
    return lm


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", help="a save_pretrained folder with tokenizer.json "
                        "(default: pretrain a small one here)")
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=100)
    parser.add_argument("--base-epochs", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=6, help="epochs per adapter")
    parser.add_argument("--rank", type=int, default=16, help="16 or 32 (LiteRT-LM's ranks)")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="outputs/finetune_and_ship")
    args = parser.parse_args(argv)

    import transformers

    from keras_attn.convert import from_huggingface, save_peft_adapter
    from keras_attn.data import dates

    os.makedirs(args.output_dir, exist_ok=True)
    splits = dates.generate_splits(args.num_train, 0, args.num_test, seed=0)
    base_dir = args.hf_dir or os.path.join(args.output_dir, "base")
    if args.hf_dir is None:
        pretrain_base(base_dir, splits["train"], epochs=args.base_epochs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    test_prompts = [PROMPT.format(human) for human, _ in splits["test"]]
    references = {form: [FORMS[form](iso) for _, iso in splits["test"]] for form in FORMS}

    base = from_huggingface(base_dir)
    base_answers = answer_ids(base, tokenizer, test_prompts)
    summary = {"base": {form: exact_match(tokenizer, base_answers, references[form])
                        for form in FORMS}, "adapters": {}}
    print(f"base model: exact match {summary['base']}")

    adapters = {}
    for form in FORMS:
        trained = train_adapter(base_dir, tokenizer, splits["train"], form, rank=args.rank,
                                epochs=args.epochs, learning_rate=args.learning_rate)
        folder = os.path.join(args.output_dir, "adapters", form)
        save_peft_adapter(trained, folder)
        # Scored as a user receives it: the base plus the PEFT folder.
        lm = from_huggingface(base_dir, adapter=folder)
        answers = answer_ids(lm, tokenizer, test_prompts)
        adapters[form] = (lm, answers)
        summary["adapters"][form] = {
            "peft_folder": folder,
            "keras": exact_match(tokenizer, answers, references[form])}
        print(f"adapter {form!r}: exact match in Keras {summary['adapters'][form]['keras']:.2f}")

    ok = ship(args, base_dir, test_prompts, references, adapters, summary)
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if ok else 1


def ship(args, base_dir, test_prompts, references, adapters, summary):
    """Each fine-tune in each runtime: its exact match and whether its answers
    are Keras's. One base serves both adapters in each runtime."""
    ok = True
    for runtime, run in (("onnxruntime_genai", ship_genai), ("litert_lm", ship_litertlm)):
        for form, (texts, keras_texts) in run(args, base_dir, test_prompts, adapters).items():
            equal = sum(t == k for t, k in zip(texts, keras_texts))
            result = {
                "exact_match": sum(t.strip() == r for t, r in zip(texts, references[form]))
                / len(texts),
                "answers_equal_to_keras": equal / len(texts)}
            summary["adapters"][form][runtime] = result
            ok &= equal == len(texts)
            print(f"adapter {form!r} in {runtime}: exact match {result['exact_match']:.2f}, "
                  f"answers equal to Keras's: {equal}/{len(texts)}")
    return ok


def ship_genai(args, base_dir, test_prompts, adapters, max_new_tokens=12):
    """An ONNX Runtime GenAI folder holding the base once, and one
    `.onnx_adapter` file per fine-tune, activated per generator."""
    import numpy as np
    import onnxruntime_genai as og

    from keras_attn.runtimes import export_onnx_genai, save_onnx_adapter

    folder = os.path.join(args.output_dir, "onnx_genai")
    forms = list(adapters)
    first = adapters[forms[0]][0]
    export_onnx_genai(first, folder, max_length=64, tokenizer=base_dir, eos_token_id=EOS,
                      adapters=True)
    files = {forms[0]: os.path.join(folder, "adapter.onnx_adapter")}
    for form in forms[1:]:
        files[form] = save_onnx_adapter(adapters[form][0],
                                        os.path.join(folder, f"{form}.onnx_adapter"),
                                        folder=folder)
    model = og.Model(folder)
    og_tokenizer = og.Tokenizer(model)
    loaded = og.Adapters(model)
    for form, path in files.items():
        loaded.load(path, form)
    answers = {}
    for form in forms:
        answers[form] = []
        for prompt in test_prompts:
            ids = np.asarray(og_tokenizer.encode(prompt), np.int32)
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
            generator = og.Generator(model, params)
            generator.set_active_adapter(loaded, form)
            generator.append_tokens(ids[None])
            while not generator.is_done():
                generator.generate_next_token()
            answers[form].append(until_eos(generator.get_sequence(0)[len(ids):]))
    return {form: ([og_tokenizer.decode(a) for a in answers[form]],
                   [og_tokenizer.decode(a) for a in adapters[form][1]]) for form in forms}


def ship_litertlm(args, base_dir, test_prompts, adapters, max_new_tokens=12):
    """One `.litertlm` bundle whose decode and prefill take LoRA weights as
    inputs, and one LiteRT-LM LoRA file per fine-tune, given per session."""
    import litert_lm

    from keras_attn.runtimes import export_litertlm, litertlm, save_litertlm_lora

    bundle = os.path.join(args.output_dir, "model.litertlm")
    forms = list(adapters)
    # Keras was given the prompts without a start token: the bundle adds none.
    export_litertlm(adapters[forms[0]][0], bundle, tokenizer=base_dir, max_length=64,
                    bos_token_id=None, stop_token_ids=[EOS], lora_rank=args.rank)
    files = {form: save_litertlm_lora(adapters[form][0],
                                      os.path.join(args.output_dir, f"{form}.lora.tflite"),
                                      lora_rank=args.rank) for form in forms}
    litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)  # its loader's INFO lines
    engine = litert_lm.Engine(bundle, backend=litert_lm.Backend.CPU())
    try:
        # LiteRT-LM answers text: beside it, the Keras tokens detokenized by
        # the bundle's own tokenizer (equal text means the same tokens).
        return {form: ([litertlm.generate(bundle, prompt, engine=engine, lora_path=files[form],
                                          max_new_tokens=max_new_tokens)
                        for prompt in test_prompts],
                       [engine.detokenize(a) for a in adapters[form][1]]) for form in forms}
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
