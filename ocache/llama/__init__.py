"""What ocache knows about llama-server, one place each: its launch flags (``flags``), the GGUF
header (``gguf``), how it reuses a slot's prefix and takes context checkpoints (``reuse``), the
setup each tier needs (``checks``), its slot endpoints over HTTP (``slot_api``) and running it as
a child process (``server``). Facts cite the pinned source by file and line, collected in
``docs/llama-server.md``."""
