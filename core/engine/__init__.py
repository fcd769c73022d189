"""The engine: the step loop (``llm_engine.LLMEngine``), the output processor, the plugin
registry, the model resolver and the cross-component config checks."""
