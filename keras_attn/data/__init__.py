"""Data for keras_attn: the `human_dates` tfds builder and `tf.data` pipelines
(dates, text classification, causal-LM fine-tuning).

Importing this package registers the `human_dates` builder with tfds.
"""

from keras_attn.data.causal_lm import causal_lm_arrays, causal_lm_dataset
from keras_attn.data.dates import generate_examples, generate_splits
from keras_attn.data.dates_tfds import HumanDates, HumanDatesConfig, load_dates
from keras_attn.data.pipelines import (
    CharTokenizer,
    batch_and_pad,
    dates_arrays,
    dates_pipeline,
    dates_tokenizers,
    distributed_input_fn,
    encode_dates,
)
from keras_attn.data.text import (
    generate_reviews,
    load_text_classification,
    make_vectorizer,
    text_classification_pipeline,
)

__all__ = [
    "CharTokenizer",
    "HumanDates",
    "HumanDatesConfig",
    "batch_and_pad",
    "causal_lm_arrays",
    "causal_lm_dataset",
    "dates_arrays",
    "dates_pipeline",
    "dates_tokenizers",
    "distributed_input_fn",
    "encode_dates",
    "generate_examples",
    "generate_reviews",
    "generate_splits",
    "load_dates",
    "load_text_classification",
    "make_vectorizer",
    "text_classification_pipeline",
]
