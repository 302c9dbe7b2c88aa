"""A Keras callback that logs the attention grid of fixed probe inputs to TensorBoard."""

import io

import keras

from keras_attn.visualize.maps import attention_maps
from keras_attn.visualize.plots import plot_heads


class AttentionMapCallback(keras.callbacks.Callback):
    """Writes `plot_heads` of `probe_inputs` as a TensorBoard image every N epochs.

    Watch heads specialise while `fit` runs (`tensorboard --logdir log_dir`,
    tab "Images"). Only the probe call is recorded; training is unchanged.

    Args:
        probe_inputs: inputs of the model (a small fixed batch).
        log_dir: TensorBoard log directory (a subfolder `attention` is used).
        every_n_epochs: write at the end of every N-th epoch (and epoch 0).
        tokens: optional labels of the probe's positions.
        batch_index: which example of the probe batch to draw.
        layers: optional indices or names of the maps to draw.

    Example:

        model.fit(ds, epochs=10, callbacks=[AttentionMapCallback(probe, "logs")])
    """

    def __init__(self, probe_inputs, log_dir, every_n_epochs=1, tokens=None, batch_index=0,
                 layers=None):
        super().__init__()
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(
                "Received an invalid value for argument `every_n_epochs`, expected a positive "
                f"integer. Received: every_n_epochs={every_n_epochs!r}"
            )
        self.probe_inputs = probe_inputs
        self.log_dir = log_dir
        self.every_n_epochs = every_n_epochs
        self.tokens = tokens
        self.batch_index = batch_index
        self.layers = layers
        self._writer = None

    def _image(self):
        import matplotlib.pyplot as plt

        maps = attention_maps(self.model, self.probe_inputs)
        fig = plot_heads(maps, self.tokens, batch_index=self.batch_index, layers=self.layers)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=80)
        plt.close(fig)
        return buffer.getvalue()

    def on_epoch_end(self, epoch, logs=None):
        if epoch % self.every_n_epochs:
            return
        import os

        import tensorflow as tf

        from tensorflow.core.framework import summary_pb2

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "attention"))
        png = self._image()
        height, width = tf.io.decode_png(png).shape[:2]
        # A classic image summary (what `tf.summary.image` writes, which needs
        # the tensorboard package to be installed; this does not).
        image = summary_pb2.Summary.Image(height=int(height), width=int(width), colorspace=4,
                                          encoded_image_string=png)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="attention_heads",
                                                                      image=image)])
        with self._writer.as_default():
            tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=epoch)
        self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
