"""Command-line argument types shared by the ``openmsa`` commands."""

from __future__ import annotations

import argparse

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_device(text: str) -> torch.device:
    """``--device``: cpu or cuda (cuda:N), refused when this torch sees no such device."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this torch ({torch.__version__}) sees no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device
