"""mlx-lm's OpenAI-style server (``mlx_lm.server``) with mlx-spec's speculative loop.

Run: python examples/serve.py --model TARGET --draft-model DRAFT [any mlx_lm.server option]

The server generates in one worker thread. With MLX 0.32 a thread that ran a compiled function
(mlx-lm's models call compiled activations) must end with ``mx.clear_streams()``, or the process
may abort while the interpreter shuts down ("terminate called without an active exception"), with
or without mlx-spec: the thread's compile cache is otherwise freed after its Python state, and
freeing it takes the GIL, which a finalizing interpreter no longer hands out. This launcher ends
the server's generation thread that way, so Ctrl-C exits with status 0."""

import importlib
import sys

import mlx.core as mx

from mlx_spec import patch_mlx_lm

patch_mlx_lm()
# Imported after the patch, the server takes the patched functions it imports from mlx-lm.
server = importlib.import_module("mlx_lm.server")
generation_thread = server.ResponseGenerator._run_generate


def generate_then_clear_streams(self: server.ResponseGenerator) -> None:
    try:
        generation_thread(self)
    finally:
        mx.clear_streams()


server.ResponseGenerator._run_generate = generate_then_clear_streams
sys.argv[0] = "mlx_lm.server"
server.main()
