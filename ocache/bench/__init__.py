"""The bench: replay recorded request streams against stock llama-server, tuned llama-server and
ocache side by side (``run``, ``replay``), the grid oracle: the longest earlier prefix, resumed on the ubatch grid (``oracle``) and
greedy exactness judged token by token (``exact``). Nothing in the runtime imports this package."""
