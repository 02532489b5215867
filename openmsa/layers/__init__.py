"""Drop-in attention layers."""

from .msa_attention import MSAAttention, MSAWarmupSchedule, set_msa_warmup

__all__ = ["MSAAttention", "MSAWarmupSchedule", "set_msa_warmup"]
