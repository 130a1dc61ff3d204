"""Sequential codecs: token ids coded under the model, K/V restored by recomputation."""
