"""KV-cache bookkeeping shared by backends: the prefix cache and the start of a cached hit."""
