"""``openmsa train``: a small GQA transformer learns long-context retrieval with MSA."""
