"""The HTTP frontend: SGLang's and vLLM's token-in/token-out APIs over a fleet of sidecars."""
