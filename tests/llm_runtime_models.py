"""Models and a tokenizer shared by the LLM-runtime tests (ONNX Runtime GenAI,
LiteRT-LM): a byte-level BPE tokenizer trained offline, a random decoder
whose logits are spread so that greedy generations vary, and Keras's greedy
tokens as the reference."""

import numpy as np
import tokenizers

from keras_attn.generation import DecoderOnlyLM, greedy_search

WORDS = ("the a cat dog sat ran on in under over mat box red blue small big and then it was "
         "very quite happy sad one two three four five six seven eight nine ten day night").split()
EOS = 1
MAX_LEN = 40


def word_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer.json, trained offline here on
    sentences of `WORDS` (ONNX Runtime GenAI's tokenizer reads BPE, WordPiece
    and Unigram models; not WordLevel)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, 8)) for _ in range(400)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


VOCAB = 320


def scaled_lm(**kwargs):
    lm = DecoderOnlyLM(VOCAB, 64, 32, num_layers=2, num_heads=4, intermediate_dim=48,
                       pad_token_id=0, **kwargs)
    lm(np.array([[2, 3]], np.int32))
    rng = np.random.default_rng(0)
    for w in lm.weights:  # spread logits: generations that vary
        w.assign(w.numpy() * 3 + rng.standard_normal(w.shape).astype("float32") * 0.05)
    # Never the stop token: generations run to max_length (the converted
    # models below stop on theirs).
    bias = lm.lm_head.bias.numpy()
    bias[EOS] = -1e4
    lm.lm_head.bias.assign(bias)
    return lm


def keras_tokens(lm, prompt, max_length, eos=EOS):
    """Keras greedy tokens after the prompt, up to (not including) the stop token."""
    tokens = greedy_search(lm, np.array([prompt], np.int32), max_length, stop_token_ids=(eos,))
    new = list(np.asarray(tokens)[0, len(prompt):])
    return new[:new.index(eos)] if eos in new else new


def hf_model(family):
    """A small seeded random Hugging Face `gpt2` or `llama` causal LM on this
    vocabulary (EOS = stop token), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            initializer_range=0.3, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=64, initializer_range=0.2,
            bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0))
    return hf.eval()
