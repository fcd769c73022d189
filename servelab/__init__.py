"""servelab: a plugin-based, modular LLM serving framework.

The public API: ``LLM`` for offline generation, ``SamplingParams`` per request,
``LLMEngine`` for step-by-step control, and the output types.
"""

from servelab.core.engine import LLMEngine
from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.llm import LLM
from servelab.core.outputs import CompletionOutput, RequestOutput
from servelab.core.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "ConfigError",
           "InvalidRequestError"]
