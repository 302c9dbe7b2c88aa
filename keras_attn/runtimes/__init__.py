"""What writes and runs LLM-runtime artifacts, one module per runtime.

Every writer takes the same trace of the model (`trace.DecoderTrace`: its
prefill and decode steps and its cache layout) and adds only its own
contract:

- `signatures`: `prefill` / `decode` (/ `generate`) signatures as a
  SavedModel (TF Serving), a TFLite model (LiteRT) and ONNX files
  (onnxruntime), with their request checks (`request_checks`);
- `litertlm`: `.litertlm` bundles for LiteRT-LM;
- `onnx_genai`: model folders for ONNX Runtime GenAI;
- `tflite_convert`: several `tf.function`s into one TFLite flatbuffer;
- `tokenizers`: `tokenizer.json` files for keras_attn's own vocabularies;
- `loop`: the NumPy greedy loop an app runs next to the signatures;
- `verification`: each prefill/decode artifact run against Keras, and the
  `SignatureReport` its writer returns.

The models and the searches are `keras_attn.generation`'s.
"""

from keras_attn.runtimes.litertlm import LitertLmReport, export_litertlm, save_litertlm_lora
from keras_attn.runtimes.loop import greedy_loop
from keras_attn.runtimes.onnx_genai import export_onnx_genai, save_onnx_adapter
from keras_attn.runtimes.signatures import (
    export_onnx,
    export_saved_model,
    export_tflite,
    onnx_models,
    signature_functions,
    tflite_bytes,
)
from keras_attn.runtimes.tokenizers import (
    bpe_tokenizer, character_tokenizer, word_tokenizer, write_tokenizer)
from keras_attn.runtimes.trace import DecoderTrace
from keras_attn.runtimes.verification import SignatureReport

__all__ = [
    "DecoderTrace",
    "LitertLmReport",
    "SignatureReport",
    "bpe_tokenizer",
    "character_tokenizer",
    "export_litertlm",
    "export_onnx",
    "export_onnx_genai",
    "export_saved_model",
    "export_tflite",
    "greedy_loop",
    "onnx_models",
    "save_litertlm_lora",
    "save_onnx_adapter",
    "signature_functions",
    "tflite_bytes",
    "word_tokenizer",
    "write_tokenizer",
]
