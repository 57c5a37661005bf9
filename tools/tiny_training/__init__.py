"""Training the embedded tiny model (``replicas.tiny`` holds the trained checkpoint, its
tokenizer and its task)."""
