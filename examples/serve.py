"""mlx-lm's OpenAI-style server (``mlx_lm.server``) with mlx-spec's speculative loop.

Run: python examples/serve.py --model TARGET (--draft-model DRAFT | --mtp | --prompt-lookup)
[any mlx_lm.server option]

``patch_mlx_lm()`` routes the server's requests with a draft model through mlx-spec's loop, and
batches concurrent ones (``mlx_spec.serving``) where the target's and the draft model's caches
batch (all ``KVCache``); a request with a seed, a logit bias or a penalty, or more
``num_draft_tokens`` than ``--num-draft-tokens``, is served alone. It also makes the server
answer every request: an error during a generation becomes an HTTP error (400
for an argument the loop refuses, such as ``num_draft_tokens`` above 64), and a prompt that its
prompt cache holds exactly gets its next token. It also ends the server's generation thread with
``mx.clear_streams()``: with MLX 0.32 a thread that ran a compiled function (mlx-lm's models call
compiled activations) must, or the process may abort while the interpreter shuts down
("terminate called without an active exception"), with or without mlx-spec. So Ctrl-C exits
with status 0.

``--mtp``, taken off before mlx-lm's server reads the rest, is ``patch_mlx_lm(mtp=True)``: a model
whose folder holds its MTP head (``mlx-spec convert-mtp HF_DIR MLX_DIR`` writes it) drafts with
it, no draft model needed; the server then serves its requests one at a time instead of batched.
``--prompt-lookup`` is ``patch_mlx_lm(prompt_lookup=True)``: without a draft model, requests
draft by prompt lookup, batched as above.
"""

import sys

from mlx_spec import patch_mlx_lm

OURS = ("--mtp", "--prompt-lookup")
patch_mlx_lm(mtp="--mtp" in sys.argv[1:], prompt_lookup="--prompt-lookup" in sys.argv[1:])
# The patch imported the server and replaced the functions it takes from mlx-lm.
from mlx_lm import server  # noqa: E402

sys.argv = ["mlx_lm.server", *(arg for arg in sys.argv[1:] if arg not in OURS)]
server.main()
