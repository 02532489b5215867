"""``openmsa bench``: timings of MSA against dense attention on the same GPU run."""
