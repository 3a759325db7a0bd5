"""Ray actor classes: thin wrappers that run engine/ and cluster/ logic inside Ray processes."""
