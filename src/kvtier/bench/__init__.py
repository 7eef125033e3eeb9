"""Everything ``kvtier bench`` runs: the serving benchmark against vLLM's own tiers."""
