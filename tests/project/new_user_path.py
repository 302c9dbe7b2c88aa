"""What a new user does first, as one script (tests/project/test_new_user_path.py runs
it in a fresh interpreter): import keras_attn first, convert a Hugging Face
Llama saved with `save_pretrained`, generate the same greedy tokens as
`transformers`, export the TFLite generation signatures and generate with
them, export a small classifier to every format, and write the attention
explorer. Prints one JSON line of what it found; exits non-zero on failure.

    python tests/project/new_user_path.py OUTPUT_DIR
"""

import json
import os
import sys
import time

import keras_attn  # noqa: F401  first, as a new user's script does (issue 39)
import keras
import numpy as np

from keras_attn.convert import from_huggingface
from keras_attn.export import export_all
from keras_attn.generation import greedy_search
from keras_attn.runtimes import greedy_loop
from keras_attn.runtimes import signatures
from keras_attn.visualize import attention_maps, html_view

out = sys.argv[1]
summary = {}
start = time.perf_counter()

# torch and transformers after TensorFlow: the order that used to abort in
# triton/knobs.py when torch's CUDA build (with triton) is installed.
import torch  # noqa: E402
import transformers  # noqa: E402

summary["torch"] = torch.__version__
config = transformers.LlamaConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
hf = transformers.LlamaForCausalLM(config).eval()
with torch.no_grad():
    for parameter in hf.parameters():
        if parameter.dim() == 2:  # sharp attention, spread logits: varied greedy tokens
            parameter.mul_(8.0)
hf.save_pretrained(os.path.join(out, "tiny-llama"))
summary["triton_loaded"] = "triton._C.libtriton" in sys.modules

lm = from_huggingface(os.path.join(out, "tiny-llama"))
prompt = np.array([[5, 17, 42, 8, 33]], "int32")
max_length = 14
tokens = np.asarray(greedy_search(lm, prompt, max_length=max_length, pad_token_id=0))
with torch.no_grad():
    want = hf.generate(torch.tensor(prompt, dtype=torch.long),
                       attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                       do_sample=False, max_length=max_length, pad_token_id=0,
                       eos_token_id=None).numpy()
summary["greedy_equals_transformers"] = bool(np.array_equal(tokens, want))
summary["distinct_generated"] = len(np.unique(tokens[:, prompt.shape[1]:]))

# The TFLite prefill/decode signatures, run by LiteRT with the NumPy loop an app copies.
from ai_edge_litert import interpreter as litert  # noqa: E402

path = signatures.export_tflite(lm, os.path.join(out, "llama.tflite"), max_length=max_length,
                                batch_size=1, prompt_length=prompt.shape[1])
runner = litert.Interpreter(model_path=path)
tflite_tokens = greedy_loop(runner.get_signature_runner("prefill"),
                            runner.get_signature_runner("decode"), prompt, max_length)
summary["tflite_equals_keras"] = bool(np.array_equal(np.asarray(tflite_tokens), tokens))

# A small classifier built the way the getting-started guide does, every format.
classifier = keras.Sequential([
    keras.Input((None,), dtype="int32", name="token_ids"),
    keras_attn.TokenAndPositionEmbedding(61, 16, 16, mask_zero=True),
    keras_attn.TransformerEncoderBlock(num_heads=2, intermediate_dim=32),
    keras.layers.GlobalAveragePooling1D(),
    keras.layers.Dense(3, name="logits"),
])
reports = export_all(classifier, os.path.join(out, "classifier"), verbose=False)
summary["exports"] = {key: {"max_abs_error": r.max_abs_error, "check_ids": r.details["check_ids"]}
                      for key, r in reports.items()}

maps = attention_maps(lm, prompt)
labels = [f"t{i}" for i in prompt[0]]
html = html_view(maps, labels, os.path.join(out, "attention.html"))
summary["attention_maps"] = len(maps)
summary["html_bytes"] = os.path.getsize(os.path.join(out, "attention.html"))
summary["seconds"] = round(time.perf_counter() - start, 1)
print("NEW_USER_PATH " + json.dumps(summary), flush=True)
