"""trajstore's recording proxy: an OpenAI-compatible gateway in front of inference engines."""
