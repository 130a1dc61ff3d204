"""Session codecs: token ids coded under the model, K/V restored by recomputation.

The interface is session_codec.py; registry.py finds codecs by id and says what each can do.
"""
