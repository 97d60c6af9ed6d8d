"""Build tooling, kept apart from the runtime: the patched llama-server (``engine``), the small
generated GGUF models (``models``) and the real coding-agent clients from npm (``clients``), each
cached under ``~/.cache/ocache`` keyed by its inputs."""
