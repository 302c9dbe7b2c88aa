"""Public Keras layers of keras_attn."""

from keras_attn.layers.additive_attention import AdditiveAttention
from keras_attn.layers.alibi_bias import AlibiBias
from keras_attn.layers.dot_product_attention import DotProductAttention
from keras_attn.layers.learned_position_embedding import LearnedPositionEmbedding
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.relative_position_bias import RelativePositionBias
from keras_attn.layers.reversible_embedding import ReversibleEmbedding
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.layers.sentence_pooling import SentencePooling
from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

__all__ = [
    "AdditiveAttention",
    "AlibiBias",
    "DotProductAttention",
    "LearnedPositionEmbedding",
    "MultiHeadAttention",
    "RelativePositionBias",
    "ReversibleEmbedding",
    "RotaryEmbedding",
    "SentencePooling",
    "SinusoidalPositionEncoding",
    "TokenAndPositionEmbedding",
    "TransformerDecoderBlock",
    "TransformerEncoderBlock",
]
