"""The attention options of ``openmsa bench``'s arguments, shared by its training-step and
decode modes."""


def msa_options(args) -> dict:
    """The selection options of ``args`` as ``msa_attention`` / ``msa_decode`` take them."""
    return dict(top_k=args.top_k, block_size=args.block_size,
                index_precision=args.index_precision,
                num_local_blocks=getattr(args, "num_local_blocks", 1),
                local_block_dilation=getattr(args, "local_block_dilation", 1))


def step_options(args) -> dict:
    """``msa_attention``'s options of a timed training step: the selection options and the
    kernels' routes (``--tuning``; "auto": a new ``AutoTuning``, each call's route from the
    previous call's measurement)."""
    from ..ops.auto_tuning import own_tuning

    return dict(msa_options(args), tuning=own_tuning(args.tuning))
