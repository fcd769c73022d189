"""Errors servelab raises for bad configuration and bad requests."""


class ConfigError(ValueError):
    """A configuration that cannot work; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        bullet = "\n  - "
        super().__init__("invalid servelab configuration:" + bullet + bullet.join(self.problems))


class InvalidRequestError(ValueError):
    """A request rejected before it enters the engine; ``field`` names the culprit."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        """Pickle by field and message (the server gets it from the engine process)."""
        return type(self), (self.field, self.message)


class ProposalError(ValueError):
    """A decoding strategy proposed drafts the engine cannot verify (a malformed token
    tree); names the request and the rule broken."""

    def __init__(self, request_id: str, strategy: str, rule: str):
        self.request_id = request_id
        self.strategy = strategy
        self.rule = rule
        super().__init__(f"request {request_id!r}: the token tree proposed by {strategy} is refused: {rule}")

    def __reduce__(self):
        """Pickle by request, strategy and rule (the server gets it from the engine process)."""
        return type(self), (self.request_id, self.strategy, self.rule)


class EngineShutdownError(RuntimeError):
    """An engine used after ``shutdown``: it holds no model, workers or KV cache any more."""

    def __init__(self, operation: str):
        self.operation = operation
        super().__init__(f"{operation}: this engine has been shut down (LLM.shutdown / LLMEngine.shutdown); "
                         f"build a new LLM or LLMEngine")

    def __reduce__(self):
        """Pickle by operation (the server gets it from the engine process)."""
        return type(self), (self.operation,)
