"""The client-facing API shapes: the Anthropic Messages and OpenAI Responses bodies in llama-server's
chat form (``convert``), and the reuse figures a response reports, corrected for ocache's own
prefill (``figures``)."""
