"""One module per stage of MSA; ``msa`` joins them into the public functions."""
