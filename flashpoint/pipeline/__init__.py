"""Pipelined inference across stage processes (partitioned models, thesis §4.1.3).

- :mod:`.frames`  activation frames: fixed binary headers + raw tensor bytes (pure codec)
- :mod:`.link`    ActivationLink: frames over one authenticated data-plane connection
- :mod:`.stage`   StageServer (torch): run a stage, forward, relay replies; the stage process
- :mod:`.client`  PipelineClient (numpy only): concurrent requests into the first stage

``StageServer`` is imported from :mod:`flashpoint.pipeline.stage` so that importing the
client never imports torch.
"""

from flashpoint.pipeline.client import PipelineClient
from flashpoint.pipeline.frames import DType, Frame, FrameKind, decode_frame, encode_error, encode_frame

__all__ = ["DType", "Frame", "FrameKind", "PipelineClient", "decode_frame", "encode_error",
           "encode_frame"]
