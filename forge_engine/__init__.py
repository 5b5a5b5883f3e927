"forge-engine: a small, readable, real inference engine for the Qwen3 family."
__version__ = "0.1.0"

# The public API, imported on first use so `import forge_engine.config` stays light.
_PUBLIC = {"LLM": "forge_engine.llm", "RequestOutput": "forge_engine.engine", "SamplingParams": "forge_engine.generate"}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name in _PUBLIC:
        import importlib
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'forge_engine' has no attribute {name!r}")
