"""Operations: inventory (usage, purge, manifests), the metrics vocabulary, log setup."""
