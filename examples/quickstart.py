"""mlx-spec in one screen: greedy and sampled acceptance of a draft, and a batch through mx.vmap.

Run: python examples/quickstart.py
"""

import mlx.core as mx

import mlx_spec

V, N = 8, 3  # vocabulary size, draft length

# The target scored the N + 1 positions of [last token, d0, d1, d2] in one forward pass.
logits = mx.random.normal((1, 12, V), key=mx.random.key(0))[0, -(N + 1) :]
target_choice = mx.argmax(logits, axis=-1)
print("target argmax per position:", target_choice.tolist())

# Greedy: the draft agrees with the target on its first two tokens only.
draft = mx.concatenate([target_choice[:2], (target_choice[2:3] + 1) % V]).astype(mx.uint32)
accepted, next_token, eos_hit = mlx_spec.read(mlx_spec.accept_greedy(logits, draft))
print(f"greedy:  draft {draft.tolist()} -> keep {accepted}, then {next_token} (eos: {eos_hit})")

# Sampled: rejection sampling against the target's distribution p, with the drafter's q.
p = mx.softmax(logits, axis=-1)
q = mx.softmax(logits[:N] + mx.random.normal((N, V), key=mx.random.key(1)), axis=-1)
draft = mx.random.categorical(mx.log(q), key=mx.random.key(2)).astype(mx.uint32)
eos = mx.array([V - 1], dtype=mx.uint32)
result = mlx_spec.accept_sampled(p, draft, q, eos, mx.random.key(3))
print("sampled: draft", draft.tolist(), "->", mlx_spec.read(result))

# A batch of 4 verification steps (different keys), one graph and one read.
keys = mx.random.split(mx.random.key(4), 4)
batch = mx.vmap(lambda k: mlx_spec.accept_sampled(p, draft, q, eos, k))(keys)
for row in mlx_spec.read(batch):
    print("batched:", row)
