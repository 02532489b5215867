"""openmsa: Triton training kernels for MiniMax Sparse Attention (MSA)."""

from .layers import MSAAttention, MSAWarmupSchedule, set_msa_warmup
from .ops.auto_tuning import AutoTuning
from .ops.decode import msa_decode
from .ops.msa import msa_attention, naive_msa_attention, select_blocks, sparse_attention

__version__ = "0.1.0"

__all__ = [
    "msa_attention", "msa_decode", "naive_msa_attention", "select_blocks", "sparse_attention",
    "MSAAttention", "AutoTuning",
    "MSAWarmupSchedule", "set_msa_warmup", "__version__",
]
