"""Models and a tokenizer shared by the LLM-runtime tests (ONNX Runtime GenAI,
LiteRT-LM): a byte-level BPE tokenizer trained offline, a random decoder
whose logits are spread so that greedy generations vary, and Keras's greedy
tokens as the reference."""

import functools
import numpy as np

from keras_attn.generation import DecoderOnlyLM, greedy_search
from keras_attn.runtimes.tokenizers import bpe_tokenizer
from tests import model_zoo
from tests import tolerance

WORDS = ("the a cat dog sat ran on in under over mat box red blue small big and then it was "
         "very quite happy sad one two three four five six seven eight nine ten day night").split()
EOS = 1
MAX_LEN = 40


def word_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer.json, trained offline here on
    sentences of `WORDS` (ONNX Runtime GenAI's tokenizer reads BPE, WordPiece
    and Unigram models; not WordLevel)."""
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, 8)) for _ in range(400)]
    return bpe_tokenizer(corpus, vocab_size=320)


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


# Small random checkpoints of the decoder families keras_attn.convert takes,
# with head sizes ONNX Runtime's GroupQueryAttention takes (multiples of 16).
# Mistral's window is shorter than the generation, Qwen2 has q/k/v biases and
# one key/value head, Gemma scales its embeddings and gates with tanh-GELU;
# the windows of Qwen3 and Gemma 2/3 are on some layers only.
HF_FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1)),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=6)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig",
              dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)),
    # QK-norm; a window on the second layer only.
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
                   sliding_window=6, max_window_layers=1, tie_word_embeddings=False)),
    # Sandwich norms, soft caps, sliding and full layers.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=6,
                    query_pre_attn_scalar=16, attn_logit_softcapping=3.0,
                    final_logit_softcapping=5.0, tie_word_embeddings=False)),
    # QK-norm, sandwich norms, local and global rotary bases.
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=6,
                    sliding_window_pattern=2, rope_local_base_freq=100.0, tie_word_embeddings=False)),
    # A layer without rotary positions.
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config",
                dict(num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0],
                     tie_word_embeddings=False)),
    # Rotary on half of each head, LongRoPE's short factors (the cache stays
    # within the original length).
    "phi3": ("Phi3ForCausalLM", "Phi3Config",
             dict(num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5,
                  max_position_embeddings=128, original_max_position_embeddings=64,
                  rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                    long_factor=[2.0] * 8),
                  tie_word_embeddings=False)),
}


# What HF_FAMILIES share: this vocabulary (EOS = stop token), logits spread
# by the initializer.
HF_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                 initializer_range=0.2, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0)


def hf_family(name, families=HF_FAMILIES, common=HF_COMMON, seed=0, sharpen=False, random_biases=False,
              **changes):
    """A seeded random Hugging Face causal LM, in eval mode.

    `families[name]` is (model class, config class, config arguments), each
    class itself or its name in `transformers`; the config takes `common`,
    then the family's arguments, then `changes`. With `sharpen` (the
    converters' tables, at sizes where the initializer's attention is flat):
    matrices times 8 (sharp attention, spread logits) and random norm scales
    (added to the initial ones; Gemma's, `1 + weight`, start at 0), so that a
    scale the conversion drops or misplaces shows; `random_biases` too
    replaces the biases (zeros) with N(0, 1) draws.
    """
    import torch
    import transformers

    model_cls, config_cls, arguments = (
        getattr(transformers, x) if isinstance(x, str) else x for x in families[name])
    config = config_cls(**{**common, **arguments, **changes})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if sharpen:
        with torch.no_grad():
            for parameter_name, p in model.named_parameters():
                if p.dim() == 2:
                    p.mul_(8.0)
                elif parameter_name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.3)
                elif random_biases and parameter_name.endswith("bias"):
                    p.copy_(torch.randn_like(p))
    return model


def hf_tokens(hf, prompt, max_length=MAX_LEN, eos=EOS):
    """transformers' greedy tokens after `prompt`, up to (not including) the stop token."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                          do_sample=False, max_length=max_length, pad_token_id=0, eos_token_id=eos)
    want = [int(t) for t in out.numpy()[0, len(prompt):]]
    return want[:want.index(eos)] if eos in want else want


def artifact_greedy(prefill, decode, prompt, max_length):
    """Greedy decoding with only an artifact's prefill/decode callables."""
    tokens = np.zeros((prompt.shape[0], max_length), np.int32)
    tokens[:, :prompt.shape[1]] = prompt
    out = prefill(token_ids=prompt)
    for i in range(prompt.shape[1], max_length):
        out = decode(token_ids=tokens[:, i - 1:i], index=np.array(i - 1, np.int32), cache=out["cache"])
        tokens[:, i] = np.argmax(out["logits"][:, 0], axis=-1)
    return tokens


def hf_greedy(hf, prompts, max_length, mask=None):
    """transformers' `generate(do_sample=False)` of `prompts` (a batch,
    unpadded unless `mask` says), `max_length` tokens per row, no stop token."""
    import torch

    with torch.no_grad():
        return hf.generate(
            torch.tensor(prompts, dtype=torch.long),
            attention_mask=torch.tensor(np.ones(prompts.shape, np.int64) if mask is None else mask),
            do_sample=False, max_length=max_length, pad_token_id=0, eos_token_id=None,
        ).numpy()


def tflite_signatures(lm, max_length, batch_size, prompt_length):
    """`lm`'s TFLite prefill/decode export in LiteRT's interpreter, checked to
    use builtin ops only (no Flex delegate, no custom op)."""
    from ai_edge_litert import interpreter as litert

    from keras_attn.runtimes import signatures

    content = signatures.tflite_bytes(lm, max_length=max_length, batch_size=batch_size,
                                      prompt_length=prompt_length)
    interpreter = litert.Interpreter(model_content=content)
    ops = {d["op_name"] for d in interpreter._get_ops_details()}
    assert not [o for o in ops if o.startswith("Flex") or o == "CUSTOM"], ops
    return interpreter


def assert_greedy_equals_hf(hf, lm, prompts, max_length):
    """keras_attn's `greedy_search` on `prompts` (unpadded, batch) gives
    transformers' `generate(do_sample=False)` tokens, and more than a few
    distinct ones (a degenerate generation tests nothing)."""
    want = hf_greedy(hf, prompts, max_length)
    got = np.asarray(greedy_search(lm, prompts, max_length=max_length, pad_token_id=0))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, prompts.shape[1]:])) > 3, "degenerate generation tests nothing"


def assert_left_padded_greedy_equals_hf(hf, lm, vocabulary_size, max_length, **prompts):
    """Hugging Face's batched generation: prompts left-padded with 0
    (`model_zoo.left_padded_prompts(vocabulary_size, **prompts)`), positions
    per row from the attention mask; `greedy_search` takes the same mask."""
    ids, mask = model_zoo.left_padded_prompts(vocabulary_size, **prompts)
    got = np.asarray(greedy_search(lm, ids, max_length=max_length, attention_mask=mask))
    np.testing.assert_array_equal(got, hf_greedy(hf, ids, max_length, mask))


def assert_padded_logits_equal_hf(hf, lm, vocabulary_size, err_msg=""):
    """`lm`'s logits on two rows of 13 tokens, the first right-padded after 9,
    equal transformers' at the valid positions within float32 rounding of a
    few blocks of sums per layer over the hidden, head and key sizes
    (tests/tolerance.py), and are not flat (a flat model tests nothing)."""
    import torch

    ids = np.random.default_rng(5).integers(3, vocabulary_size, size=(2, 13)).astype("int32")
    mask = np.ones_like(ids)
    mask[0, 9:] = 0
    ids[0, 9:] = 0
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(lm(ids, padding_mask=mask.astype(bool)))
    valid = mask.astype(bool)
    tolerance.assert_close(got[valid], want[valid], terms=hf.config.num_hidden_layers * 64, err_msg=err_msg)
    assert np.abs(want).max() > 1.0, "logits too flat to test anything"


@functools.lru_cache(maxsize=None)  # one training per size for the whole run (read-only)
def trained_dates_decoder(num_heads=3, intermediate_dim=96):
    """A decoder-only date translator trained here to a stated accuracy
    (character vocabulary of the dates data; text "<human date>=<iso>"), to
    judge quantized exports by: `(lm, tokenizer, width, held_out, answer,
    keras_next)`, `answer` marking the characters after "=" and
    `keras_next` Keras's next tokens on `held_out`. Heads of 16 features,
    `16 * num_heads` wide (4 heads, intermediate 128: every projection's
    input a multiple of 32, as int4 blocks need)."""
    import keras

    from keras_attn.data.dates import INPUT_ALPHABET, generate_examples
    from keras_attn.runtimes.tokenizers import character_tokenizer

    tok = character_tokenizer(INPUT_ALPHABET + "=")

    def encode(count, seed):
        seqs = [tok.encode(f"{human}={iso}").ids + [EOS] for human, iso in generate_examples(count, seed=seed)]
        data = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
        for row, seq in enumerate(seqs):
            data[row, :len(seq)] = seq
        return data

    data = encode(2000, seed=0)
    keras.utils.set_random_seed(0)
    # A Llama-like decoder (RMSNorm, SiLU gate, head size 16): what the fused
    # writer covers, so that its int8/int4 graphs are judged here.
    lm = DecoderOnlyLM(len(INPUT_ALPHABET) + 3, 64, 16 * num_heads, num_layers=2, num_heads=num_heads,
                       intermediate_dim=intermediate_dim, num_key_value_heads=1, head_dim=16, position="rotary",
                       normalization="rms_norm", use_gated_feedforward=True, activation="silu")
    lm.compile(keras.optimizers.Adam(3e-3),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    lm.fit(data[:, :-1], data[:, 1:], epochs=6, batch_size=64, verbose=0)
    held_out = encode(200, seed=98)
    # The answer's characters: after "=", up to the stop token.
    answer = np.zeros(held_out.shape, bool)
    for row, seq in enumerate(held_out):
        answer[row, list(seq).index(tok.token_to_id("=")):np.count_nonzero(seq) - 1] = True
    keras_next = np.asarray(lm(held_out)).argmax(-1)
    accuracy = (keras_next[:, :-1] == held_out[:, 1:])[answer[:, :-1]].mean()
    # Measured 0.82 (two seeds); full-range int8 weights were told apart at 0.76 already.
    assert accuracy >= 0.75, f"the model to judge int8 by is under-trained: {accuracy:.3f}"
    return lm, tok, data.shape[1], held_out, answer, keras_next


def variable_memory(variable):
    """A NumPy view of `variable`'s own buffer, read off the backend here
    (to check that an exporter's arrays are views of it, not copies)."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        return np.asarray(variable.value.read_value())
    if backend == "torch":
        return variable.value.detach().cpu().numpy()
    return np.asarray(variable.value)


def forward_greedy(lm, prompt, length):
    """`prompt` continued greedily to `length` tokens by Keras's full forward
    pass, one call per token (no cache, no TensorFlow graph: any backend).
    One shape for every call (one compilation): causal, so the zeros after
    the tokens so far do not reach them."""
    import keras

    tokens = np.zeros((1, length), np.int64)
    tokens[0, :len(prompt)] = prompt
    for i in range(len(prompt), length):
        tokens[0, i] = keras.ops.convert_to_numpy(lm(tokens))[0, i - 1].argmax()
    return [int(t) for t in tokens[0]]
