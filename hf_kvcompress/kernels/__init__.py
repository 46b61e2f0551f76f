"""Device kernels shared by the package: the one backend decision (`dispatch`: Triton for CUDA tensors when
importable, else the pure-torch reference) and lossy mode's fused attention scores of cached entries from
reference queries (`attention_scores`). The codec's own device kernels live with the codec
(`hf_kvcompress.codec.device`, `codec.device_triton`) and use `dispatch`; this package imports nothing of the
codec. See docs/kernels.md.
"""

from __future__ import annotations

from .attention import attention_scores
from .dispatch import forced, triton_available, use_triton

__all__ = ["attention_scores", "forced", "triton_available", "use_triton"]
