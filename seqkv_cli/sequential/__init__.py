"""Sequential codecs: token ids coded under the model, K/V restored by recomputation."""

from seqkv_cli.sequential.delta_topk import DeltaTopKCodec
from seqkv_cli.sequential.session_codecs import SESSION_CODECS

SESSION_CODECS[DeltaTopKCodec.codec_id] = DeltaTopKCodec
