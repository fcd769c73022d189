"""Models shipped with servelab: the trained `tiny` target and `tiny-draft` checkpoints
(folders), and `toy`, the random Llama and byte-level tokenizer built in memory."""
