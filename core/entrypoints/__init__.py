"""What users call: the offline API (``llm.LLM``), beam search over it, the ``servelab``
command line, config composition and the checkpoint quantizer."""
