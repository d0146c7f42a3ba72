"""Train the tiny target/draft pair that ships in ``mlx_spec/demo``.

One command, reproducible (fixed seeds, sorted file order, a fixed held-out split):

1. builds a corpus from text every Python install carries: the documentation in
   ``pydoc_data.topics`` and the standard library's own ``.py`` sources;
2. trains a byte-level BPE tokenizer with the ``tokenizers`` library;
3. trains the target, a Hugging Face ``LlamaForCausalLM``, with AdamW and a cosine schedule,
   then the draft, distilled from the target (KL to the target's distribution on the same batches);
4. saves both with ``save_pretrained`` (safetensors, bfloat16, shards of at most 15 MiB
   without the shard index) into ``<out>/target`` and ``<out>/draft``; the tokenizer files go
   into ``<out>/target`` only, since the draft must share them
   (``scripts/convert_demo_models.py`` copies them beside the converted draft and writes the
   shard index back). With the shipped sizes that is 8 files in all;
5. with ``--mtp``, trains an MTP head for the target (target frozen; see "the MTP head" below)
   into ``<out>/mtp-head.safetensors``, which ``scripts/convert_demo_models.py`` ships as the
   target's ``mtp.safetensors``; ``--target-from DIR`` trains only that head, for a target
   already trained (the shipped one, say), and adds its section to the report beside ``DIR``;
6. prints and writes ``<out>/train_report.json``.

It needs only torch, transformers, tokenizers, safetensors and the standard library. The corpus
lives in ``scripts/demo_corpus.py`` (standard library only), which the conversion script also
uses for its held-out prompts.

Example (one GPU, about seven minutes)::

    python3 scripts/train_demo_models.py --out /tmp/demo --device cuda --time-budget-s 360
    python3 scripts/train_demo_models.py --out /tmp/demo-quick --device cpu --quick
    python3 scripts/train_demo_models.py --out /tmp/demo-mtp --target-from mlx_spec/demo/target \
        --device cuda --steps-mtp 40000 --mtp-time-budget-s 130
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from demo_corpus import HELDOUT_MODULUS, build_corpus

EOS_TOKEN = "<|endoftext|>"
TARGET_SHARE = 2 / 3  # of --time-budget-s; the draft gets the rest


@dataclass(frozen=True)
class Arch:
    """A llama architecture: sizes that go into ``LlamaConfig``."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class MTPRecipe:
    """How the target's MTP head is trained (the target frozen)."""

    depths: int  # draft steps trained together, the head chained on its own output
    depth_weights: tuple[float, ...]  # each step's share of the loss
    seq_len: int  # head positions per window; a window holds seq_len + depths tokens
    batch: int
    steps: int
    warmup: int
    lr: float
    eval_windows: int
    eval_every: int


@dataclass(frozen=True)
class Recipe:
    """Everything that sizes a run; ``FULL`` ships, ``QUICK`` is a smoke test."""

    vocab: int
    target: Arch
    draft: Arch
    seq_len: int
    batch: int
    steps_target: int
    steps_draft: int
    warmup: int
    lr_target: float
    lr_draft: float
    eval_windows: int
    eval_every: int
    prompts: int
    prompt_len: int
    new_tokens: int
    max_train_bytes: int | None
    max_heldout_bytes: int | None
    mtp: MTPRecipe


# Sizes: a draft pass much cheaper than a target pass, so that speculation can pay on a CPU, and
# together 10.1M + 1.2M parameters, 22.7 MB in bfloat16 (the limit is 24 MB).
FULL = Recipe(
    vocab=4096,
    target=Arch(layers=6, hidden=384, intermediate=896, heads=6, kv_heads=2),
    draft=Arch(layers=1, hidden=192, intermediate=512, heads=3, kv_heads=3),
    seq_len=512,
    batch=64,
    steps_target=8000,  # about 29 passes over the 9.1M training tokens
    steps_draft=8000,
    warmup=200,
    lr_target=2e-3,
    lr_draft=3e-3,
    eval_windows=128,
    eval_every=250,
    prompts=32,
    prompt_len=32,
    new_tokens=64,
    max_train_bytes=None,
    max_heldout_bytes=None,
    # Sized for CPU training: the target's forward pass is most of a step's cost.
    mtp=MTPRecipe(
        depths=2,
        depth_weights=(1.0, 0.5),
        seq_len=256,
        batch=16,
        steps=3000,
        warmup=30,
        lr=1e-3,
        eval_windows=16,
        eval_every=50,
    ),
)

QUICK = Recipe(
    vocab=512,
    target=Arch(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1),
    draft=Arch(layers=1, hidden=32, intermediate=64, heads=1, kv_heads=1),
    seq_len=64,
    batch=8,
    steps_target=200,
    steps_draft=150,
    warmup=10,
    lr_target=5e-3,
    lr_draft=5e-3,
    eval_windows=8,
    eval_every=50,
    prompts=4,
    prompt_len=16,
    new_tokens=16,
    max_train_bytes=1_500_000,
    max_heldout_bytes=200_000,
    mtp=MTPRecipe(
        depths=2,
        depth_weights=(1.0, 0.5),
        seq_len=32,
        batch=4,
        steps=60,
        warmup=25,
        lr=2e-3,
        eval_windows=4,
        eval_every=20,
    ),
)


# --- tokenizer ------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer with one special token, ``EOS_TOKEN`` (id 0).

    Args:
        texts (list[str]): training texts.
        vocab_size (int): size of the vocabulary, the special token and 256 bytes included.

    Returns:
        tokenizers.Tokenizer: the trained tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Any, folder: Path, max_length: int) -> None:
    """Save ``tok`` so that ``AutoTokenizer`` and ``mlx_lm.load`` read it offline.

    Writes ``tokenizer.json`` and a ``tokenizer_config.json`` naming the class
    ``PreTrainedTokenizerFast``, which transformers 4 and 5 both load (``save_pretrained`` in
    transformers 5 names a class that 4 lacks). bos = eos = unk = pad = ``EOS_TOKEN``, and
    encoding adds no token to a prompt.

    Args:
        tok (tokenizers.Tokenizer): the trained tokenizer.
        folder (Path): destination folder; created if missing.
        max_length (int): the context length written as ``model_max_length``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_stream(tok: Any, texts: list[str]) -> list[int]:
    """Encode texts into one token stream, each document followed by the EOS id.

    Args:
        tok (tokenizers.Tokenizer): the tokenizer.
        texts (list[str]): documents.

    Returns:
        list[int]: the concatenated token ids.
    """
    eos = tok.token_to_id(EOS_TOKEN)
    stream: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream += enc.ids
        stream.append(eos)
    return stream


# --- models ---------------------------------------------------------------------------------


def make_config(arch: Arch, vocab: int, eos_id: int, max_positions: int) -> Any:
    """A ``LlamaConfig`` for ``arch`` with tied embeddings and no biases.

    Args:
        arch (Arch): the sizes.
        vocab (int): vocabulary size.
        eos_id (int): id of ``EOS_TOKEN`` (also bos and pad).
        max_positions (int): ``max_position_embeddings``.

    Returns:
        transformers.LlamaConfig: the configuration.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.hidden // arch.heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,  # rope_theta stays at 10000, the default of transformers and mlx-lm
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def count_params(model: Any) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``peak / 10`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def make_optimizer(model: Any, lr: float, fused: bool) -> Any:
    """AdamW with weight decay 0.1 on matrices only (norm weights are not decayed)."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def sample_batch(data: Any, batch: int, seq_len: int, gen: Any) -> Any:
    """Random windows of ``seq_len + 1`` tokens.

    Args:
        data (torch.Tensor): ``[T]`` int64 token stream, on the training device.
        batch (int): number of windows.
        seq_len (int): tokens fed to the model per window.
        gen (torch.Generator): a CPU generator; the windows depend only on it.

    Returns:
        torch.Tensor: ``[batch, seq_len + 1]`` int64 on ``data``'s device.
    """
    import torch

    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    offsets = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return data[offsets.to(data.device)]


def fixed_windows(data: Any, count: int, seq_len: int) -> Any:
    """``count`` evenly spaced windows of ``seq_len + 1`` tokens (the evaluation set).

    Args:
        data (torch.Tensor): ``[T]`` int64 token stream.
        count (int): number of windows wanted; fewer when the stream is short.
        seq_len (int): tokens fed to the model per window.

    Returns:
        torch.Tensor: ``[n, seq_len + 1]`` int64 on ``data``'s device, ``n <= count``.
    """
    import torch

    n = max(1, min(count, (data.numel() - 1) // (seq_len + 1)))
    stride = (data.numel() - seq_len - 1) // n
    starts = torch.arange(n) * stride
    offsets = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return data[offsets.to(data.device)]


@dataclass
class RunInfo:
    """What one training run did; goes into the report."""

    params: int
    planned_steps: int
    steps: int
    tokens_seen: int
    seconds: float
    steps_per_s: float
    final_train_loss: float
    stopped_by_budget: bool
    best_step: int
    best_heldout: float


class Trainer:
    """Shared machinery for the two training runs: device, autocast, logging, time budget."""

    def __init__(self, recipe: Recipe, device: str, seed: int, start: float) -> None:
        import torch

        self.recipe = recipe
        self.device = device
        self.seed = seed
        self.start = start
        self.autocast = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if device == "cuda"
            else contextlib.nullcontext
        )

    def log(self, msg: str) -> None:
        """Print one progress line with the elapsed wall time."""
        print(f"[{time.time() - self.start:7.1f}s] {msg}", flush=True)

    def sync(self) -> None:
        """Wait for queued device work (for honest timings)."""
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def logits(self, model: Any, x: Any) -> Any:
        """``[B, T, V]`` float32 logits of ``model`` for ``[B, T]`` int64 ids ``x``."""
        with self.autocast():
            return model(input_ids=x, use_cache=False).logits.float()

    def train(
        self,
        name: str,
        model: Any,
        data: Any,
        steps: int,
        peak_lr: float,
        budget_s: float | None,
        loss_fn: Any,
        heldout_fn: Any,
        seed_offset: int,
        recipe: Recipe | None = None,
    ) -> RunInfo:
        """Train ``model`` on random windows of ``data``.

        With a time budget, the step count is fixed once, after 20 timed steps inside the
        warm-up, to what fits the budget (never more than ``steps``); the schedule then runs
        to that count, so ``--steps-*`` with the reported count reproduces the run. Training
        also stops if the budget runs out anyway (``stopped_by_budget``).

        Args:
            name (str): label for the log lines.
            model (torch.nn.Module): the model, on the device, float32 weights.
            data (torch.Tensor): ``[T]`` int64 training stream.
            steps (int): the most steps to run.
            peak_lr (float): peak learning rate.
            budget_s (float, optional): seconds this run may take. Default: none.
            loss_fn (callable): ``loss_fn(model, batch) -> scalar tensor`` for a
                ``[B, S + 1]`` batch.
            heldout_fn (callable): ``heldout_fn() -> float``, evaluated every ``eval_every``
                steps and at the end; the weights with the lowest value are kept (early
                stopping: the corpus is small enough to memorise).
            seed_offset (int): makes this run's batch stream differ from the other's.
            recipe (Recipe, optional): the batch, window, warm-up and evaluation sizes of this
                run. Default: the trainer's.

        Returns:
            RunInfo: steps run, timings, the mean training loss of the last steps, and the step
            whose weights were kept.
        """
        import copy

        import torch

        r = recipe or self.recipe
        gen = torch.Generator().manual_seed(self.seed + seed_offset)
        opt = make_optimizer(model, peak_lr, fused=self.device == "cuda")
        model.train()
        total = steps
        calib_from, calib_to = min(5, r.warmup), min(25, r.warmup)
        recent: list[Any] = []
        last_losses: list[float] = []
        stopped = False
        best_value, best_step, best_state = float("inf"), 0, None
        self.sync()
        t0 = time.time()
        t_calib = t0
        step = 0
        while step < total:
            lr = lr_at(step, total, r.warmup, peak_lr)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = loss_fn(model, sample_batch(data, r.batch, r.seq_len, gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            recent.append(loss.detach())
            step += 1
            if budget_s is not None and step == calib_from:
                self.sync()
                t_calib = time.time()
            if budget_s is not None and step == calib_to and calib_to > calib_from:
                self.sync()
                per_step = (time.time() - t_calib) / (calib_to - calib_from)
                left = budget_s - (time.time() - t0)
                total = max(step, min(steps, step + int(0.97 * left / per_step)))
                self.log(f"{name}: {per_step * 1e3:.1f} ms/step, planning {total} steps")
            if step in (1, calib_to) or step % max(1, r.eval_every // 10) == 0 or step == total:
                mean = torch.stack(recent).mean().item()
                last_losses = [*last_losses[-9:], mean]
                recent = []
                rate = step * r.batch * r.seq_len / max(1e-9, time.time() - t0)
                self.log(
                    f"{name} step {step}/{total} loss {mean:.4f} lr {lr:.2e} {rate:,.0f} tok/s"
                )
            if step % r.eval_every == 0 and step < total:
                value = heldout_fn()
                self.log(f"{name} step {step}: held-out loss {value:.4f}")
                if value < best_value:
                    best_value, best_step = value, step
                    best_state = copy.deepcopy(model.state_dict())
                model.train()
            if budget_s is not None and time.time() - t0 > budget_s and step < total:
                self.log(f"{name}: time budget spent at step {step} of {total}")
                stopped = True
                break
        self.sync()
        seconds = time.time() - t0
        if recent:
            last_losses.append(torch.stack(recent).mean().item())
        final = heldout_fn()
        if final < best_value or best_state is None:
            best_value, best_step = final, step
        else:
            model.load_state_dict(best_state)
            self.log(f"{name}: keeping the weights of step {best_step} (held-out {best_value:.4f})")
        model.eval()
        return RunInfo(
            params=count_params(model),
            planned_steps=total,
            steps=step,
            tokens_seen=step * r.batch * r.seq_len,
            seconds=round(seconds, 2),
            steps_per_s=round(step / seconds, 3),
            final_train_loss=round(sum(last_losses[-3:]) / len(last_losses[-3:]), 4),
            stopped_by_budget=stopped,
            best_step=best_step,
            best_heldout=round(best_value, 4),
        )


def mean_over_windows(windows: Any, batch: int, fn: Any) -> float:
    """Mean of ``fn(chunk)`` over ``windows`` in chunks of ``batch``, weighted by size."""
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch]
        total += float(fn(chunk)) * chunk.shape[0]
        n += chunk.shape[0]
    return total / n


def greedy_continue(trainer: Trainer, model: Any, prompts: Any, new_tokens: int) -> Any:
    """Greedy continuation without a cache (the models are tiny).

    Args:
        trainer (Trainer): for the device and autocast.
        model (torch.nn.Module): the model.
        prompts (torch.Tensor): ``[B, P]`` int64 prompt ids.
        new_tokens (int): tokens to add.

    Returns:
        torch.Tensor: ``[B, P + new_tokens]`` int64.
    """
    import torch

    seq = prompts
    for _ in range(new_tokens):
        nxt = trainer.logits(model, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def folder_bytes(folder: Path) -> int:
    """Total size of the files in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def save_model(model: Any, folder: Path, max_shard_bytes: int) -> None:
    """``save_pretrained`` a bfloat16 copy of ``model`` as safetensors.

    Keeps ``config.json`` and the weights, in shards of at most ``max_shard_bytes`` (the GPU
    machine returns files of at most 16 MiB). The shard index is dropped to keep the output to
    few files: ``mlx_lm.load`` finds ``model*.safetensors`` without it, and
    ``scripts/convert_demo_models.py`` writes it back before converting.

    Args:
        model (torch.nn.Module): the trained model.
        folder (Path): destination folder.
        max_shard_bytes (int): largest weight file.
    """
    import copy

    import torch

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.save_pretrained(str(folder), max_shard_size=max_shard_bytes)
    for extra in ("generation_config.json", "model.safetensors.index.json"):
        (folder / extra).unlink(missing_ok=True)


def weights_bytes(folder: Path) -> int:
    """Total size of the ``model*.safetensors`` files in ``folder``."""
    return sum(p.stat().st_size for p in folder.glob("model*.safetensors"))


# --- the MTP head ---------------------------------------------------------------------------
#
# A Qwen-layout MTP head (``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
# ``mtp.layers.0.*``, ``mtp.norm``) whose layer is a llama decoder layer of the target's sizes, as
# ``mlx_spec.mtp.MTPHead`` runs it: step ``d`` (from 1) at text position ``t`` joins the
# normalized embedding of token ``t + d`` with the normalized state it starts from (the target's
# final hidden state ``h_t`` for ``d = 1``, the head's own output after its final norm for later
# steps), projects them back to the hidden size, runs the layer and the final norm, and predicts
# token ``t + d + 1`` through the target's tied LM head. Training reproduces the attention of
# drafting: the head's cache holds a step-1 entry for every position the target verified, so step
# ``d`` at ``t`` attends to the step-1 entries of positions ``<= t`` and to its own chain's entries
# of steps ``2..d``, at rotary positions ``t + d - 1``.


def make_mtp_head(target: Any) -> Any:
    """A torch MTP head for a ``LlamaForCausalLM`` target, started from the target's own weights.

    Its layer starts as a copy of the target's last layer, its final norm as the target's, and
    the projection as the sum of the two normalized inputs: a head that, before training, runs
    one more target layer on its inputs.

    Args:
        target (transformers.LlamaForCausalLM): the trained target (float32 weights).

    Returns:
        torch.nn.Module: parameters named as the Qwen layout names them, less the ``mtp.``
        prefix (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...).
    """
    import copy

    import torch

    config = target.config
    hidden, eps = config.hidden_size, config.rms_norm_eps

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
            self.pre_fc_norm_embedding = torch.nn.RMSNorm(hidden, eps=eps)
            self.pre_fc_norm_hidden = torch.nn.RMSNorm(hidden, eps=eps)
            self.layers = torch.nn.ModuleList([copy.deepcopy(target.model.layers[-1])])
            self.norm = copy.deepcopy(target.model.norm)

    head = Head()
    with torch.no_grad():
        eye = torch.eye(hidden)
        head.fc.weight.copy_(torch.cat([eye, eye], dim=1))
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def rotary(positions: Any, head_dim: int, theta: float) -> tuple[Any, Any]:
    """``cos, sin`` of llama's rotary embedding (halves rotated, as mlx-lm's non-traditional
    ``nn.RoPE``), each ``[S, head_dim]`` float32 for ``[S]`` int64 ``positions``."""
    import torch

    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv = 1.0 / theta ** (steps / head_dim)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: Any, cos: Any, sin: Any) -> Any:
    """``x`` ``[B, heads, S, D]`` rotated by ``cos, sin`` ``[S, D]``."""
    import torch

    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def mtp_steps(head: Any, target: Any, hidden: Any, tokens: Any, depths: int) -> list[Any]:
    """The head's logits at each of ``depths`` chained steps, for every position of a window.

    Args:
        head (torch.nn.Module): from :func:`make_mtp_head`.
        target (transformers.LlamaForCausalLM): the frozen target (its embedding and config).
        hidden (torch.Tensor): ``[B, S, H]`` float32, the target's final hidden states (after its
            final norm) at positions ``0..S-1``.
        tokens (torch.Tensor): ``[B, S + depths]`` int64, the window's tokens.
        depths (int): chained steps, ``>= 1``.

    Returns:
        list[torch.Tensor]: for step ``d`` (from 1), ``[B, S, V]`` float32 logits of the token at
        ``t + d + 1`` for each position ``t``.
    """
    import torch

    config = target.config
    layer = head.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    embed = target.model.embed_tokens.weight
    batch, seq, _ = hidden.shape
    causal = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).tril()

    def split_heads(x: Any, n: int) -> Any:
        return x.view(batch, seq, n, head_dim).transpose(1, 2)

    def widen(x: Any) -> Any:  # grouped-query attention: each KV head serves consecutive heads
        return x.repeat_interleave(heads // kv_heads, dim=1)

    first_k = first_v = None
    chain_k: list[Any] = []
    chain_v: list[Any] = []
    state, out_logits = hidden, []
    for d in range(1, depths + 1):
        e = torch.nn.functional.embedding(tokens[:, d : d + seq], embed)
        x = head.fc(
            torch.cat([head.pre_fc_norm_embedding(e), head.pre_fc_norm_hidden(state)], dim=-1)
        )
        a = layer.input_layernorm(x)
        cos, sin = rotary(torch.arange(seq, device=hidden.device) + d - 1, head_dim, theta)
        q = rotate(split_heads(attn.q_proj(a), heads), cos, sin)
        k = widen(rotate(split_heads(attn.k_proj(a), kv_heads), cos, sin))
        v = widen(split_heads(attn.v_proj(a), kv_heads))
        scale = head_dim**-0.5
        if d == 1:
            first_k, first_v = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        scores = (q @ first_k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        own = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_k]
        weights = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)
        mixed = weights[..., :seq] @ first_v
        for i, cv in enumerate(chain_v):
            mixed = mixed + weights[..., seq + i : seq + i + 1] * cv
        x = x + attn.o_proj(mixed.transpose(1, 2).reshape(batch, seq, heads * head_dim))
        x = x + mlp(layer.post_attention_layernorm(x))
        state = head.norm(x)
        out_logits.append((state @ embed.T).float())
    return out_logits


def mtp_loss_terms(head: Any, target: Any, window: Any, depths: int) -> tuple[list[Any], list[Any]]:
    """Per step, ``KL(target || head)`` and the argmax agreement, on one batch of windows.

    Step ``d`` at position ``t`` is compared with the target's distribution at ``t + d``: the
    target's prediction of the token the head predicts.

    Args:
        head (torch.nn.Module): from :func:`make_mtp_head`.
        target (transformers.LlamaForCausalLM): the frozen target.
        window (torch.Tensor): ``[B, S + depths]`` int64 tokens.
        depths (int): chained steps.

    Returns:
        tuple: ``depths`` scalar KL tensors (nats per position, with gradients) and ``depths``
        scalar agreement tensors (fractions, no gradients).
    """
    import torch
    import torch.nn.functional as F

    seq = window.shape[1] - depths
    with torch.no_grad():
        states = target.model(input_ids=window, use_cache=False).last_hidden_state
        teacher = F.log_softmax(target.lm_head(states).float(), dim=-1)
    steps = mtp_steps(head, target, states[:, :seq], window, depths)
    kls, agree = [], []
    for d, logits in enumerate(steps, start=1):
        want = teacher[:, d : d + seq]
        student = F.log_softmax(logits, dim=-1)
        kls.append(
            F.kl_div(
                student.flatten(0, 1), want.flatten(0, 1), log_target=True, reduction="batchmean"
            )
        )
        agree.append((logits.argmax(-1) == want.argmax(-1)).float().mean().detach())
    return kls, agree


def save_mtp_head(head: Any, file: Path) -> int:
    """Save ``head``'s weights, float32, under the Qwen layout's names (``mtp.fc.weight``, ...),
    which ``scripts/convert_demo_models.py`` turns into the shipped ``mtp.safetensors``.

    Args:
        head (torch.nn.Module): from :func:`make_mtp_head`.
        file (Path): the ``.safetensors`` file to write.

    Returns:
        int: the file's size in bytes.
    """
    from safetensors.torch import save_file

    weights = {f"mtp.{k}": v.detach().float().contiguous() for k, v in head.state_dict().items()}
    save_file(weights, str(file), metadata={"layout": "qwen", "layers": "1"})
    return file.stat().st_size


def train_mtp(
    trainer: Trainer,
    target: Any,
    train_data: Any,
    heldout_data: Any,
    steps: int | None,
    budget_s: float | None,
    out: Path,
) -> dict[str, Any]:
    """Train the MTP head of the frozen ``target`` by distillation and save it.

    Args:
        trainer (Trainer): the run's trainer; its recipe's ``mtp`` sizes the run.
        target (transformers.LlamaForCausalLM): the trained target, float32, frozen here.
        train_data (torch.Tensor): ``[T]`` int64 training stream.
        heldout_data (torch.Tensor): ``[T']`` int64 held-out stream.
        steps (int, optional): the most steps. Default: the recipe's.
        budget_s (float, optional): seconds training may take. Default: none.
        out (Path): the run's folder; the head goes to ``<out>/mtp-head.safetensors``.

    Returns:
        dict: the report's ``mtp`` section.
    """
    import dataclasses

    import torch

    m = trainer.recipe.mtp
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    head = make_mtp_head(target).to(trainer.device)
    weights = torch.tensor(m.depth_weights[: m.depths], device=trainer.device)
    windows = fixed_windows(heldout_data, m.eval_windows, m.seq_len + m.depths - 1)

    def loss(model: Any, window: Any) -> Any:
        kls, _ = mtp_loss_terms(model, target, window, m.depths)
        return (torch.stack(kls) * weights).sum()

    @torch.no_grad()
    def heldout() -> float:
        head.eval()
        return mean_over_windows(windows, m.batch, lambda w: loss(head, w))

    @torch.no_grad()
    def heldout_terms() -> tuple[list[float], list[float]]:
        head.eval()
        kls, agree = [0.0] * m.depths, [0.0] * m.depths
        for i in range(0, windows.shape[0], m.batch):
            chunk = windows[i : i + m.batch]
            share = chunk.shape[0] / windows.shape[0]
            kl_terms, agree_terms = mtp_loss_terms(head, target, chunk, m.depths)
            for d, (kl, a) in enumerate(zip(kl_terms, agree_terms, strict=True)):
                kls[d] += kl.item() * share
                agree[d] += a.item() * share
        return kls, agree

    sizes = dataclasses.replace(
        trainer.recipe,
        batch=m.batch,
        seq_len=m.seq_len + m.depths - 1,
        warmup=m.warmup,
        eval_every=m.eval_every,
    )
    trainer.log(f"mtp head: {count_params(head):,} parameters, {m.depths} chained steps")
    run = trainer.train(
        "mtp",
        head,
        train_data,
        steps or m.steps,
        m.lr,
        budget_s,
        loss,
        heldout,
        seed_offset=3,
        recipe=sizes,
    )
    file_bytes = save_mtp_head(head, out / "mtp-head.safetensors")
    kls, agree = heldout_terms()
    trainer.log(f"mtp done: held-out KL per step {kls}, agreement per step {agree}")
    return {
        **asdict(run),
        "final_train_loss_is": "sum over steps d of weight_d * KL(target || head), nats",
        "heldout_kl_at_step": [round(k, 4) for k in kls],
        "heldout_text_agreement_at_step": [round(a, 4) for a in agree],
        "heldout_text_positions": int(windows.shape[0] * m.seq_len),
        "head_file_bytes_float32": file_bytes,
    }


# --- the run --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--steps-target", type=int, default=None, help="most target steps")
    p.add_argument("--steps-draft", type=int, default=None, help="most draft steps")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few steps (smoke test)")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="training seconds for both models: 2/3 target, 1/3 draft (setup not counted)",
    )
    p.add_argument(
        "--max-shard-mb",
        type=float,
        default=15.0,
        help="largest weight file in MiB (default 15: the GPU machine returns files <= 16 MiB)",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="also train the target's MTP head (<out>/mtp-head.safetensors), after the draft",
    )
    p.add_argument("--steps-mtp", type=int, default=None, help="most MTP head steps")
    p.add_argument(
        "--mtp-time-budget-s",
        type=float,
        default=None,
        help="training seconds for the MTP head (setup and evaluation not counted)",
    )
    p.add_argument(
        "--target-from",
        type=Path,
        default=None,
        help="a trained target's folder (a Hugging Face or mlx-lm llama folder with the "
        "tokenizer files, mlx_spec/demo/target say): train only its MTP head; the report is "
        "the train_report.json beside that folder, with the mtp section added",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    return p.parse_args(argv)


def main_mtp_only(
    args: argparse.Namespace, trainer: Trainer, argv: list[str] | None
) -> dict[str, Any]:
    """Train the MTP head of the target in ``args.target_from`` (frozen) on the corpus it was
    trained on, tokenized with its own tokenizer; writes ``<out>/mtp-head.safetensors`` and
    ``<out>/train_report.json``: the report beside the target's folder (where there is one) with
    the ``mtp`` section, which records this run's command, device and versions."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    r, out = trainer.recipe, args.out
    out.mkdir(parents=True, exist_ok=True)
    source: Path = args.target_from
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    train_texts, heldout_texts = build_corpus(r.max_train_bytes, r.max_heldout_bytes)
    train_ids, heldout_ids = encode_stream(tok, train_texts), encode_stream(tok, heldout_texts)
    trainer.log(f"corpus: {len(train_ids):,} train tokens, {len(heldout_ids):,} held-out tokens")
    target = LlamaForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(trainer.device)
    mtp = train_mtp(
        trainer,
        target,
        torch.tensor(train_ids, dtype=torch.long, device=trainer.device),
        torch.tensor(heldout_ids, dtype=torch.long, device=trainer.device),
        args.steps_mtp,
        args.mtp_time_budget_s,
        out,
    )
    base = source.parent / "train_report.json"
    report = json.loads(base.read_text()) if base.is_file() else {}
    mtp["run"] = {
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "device": trainer.device,
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "recipe": asdict(r.mtp),
        "wall_seconds": round(time.time() - trainer.start, 1),
    }
    report["mtp"] = mtp
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(mtp, indent=2), flush=True)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run everything; returns the report that is also written to ``train_report.json``."""
    start = time.time()
    args = parse_args(argv)
    import tokenizers
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaForCausalLM

    r = QUICK if args.quick else FULL
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("high")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    trainer = Trainer(r, device, args.seed, start)
    log = trainer.log
    if args.target_from is not None:
        return main_mtp_only(args, trainer, argv)
    out: Path = args.out
    target_dir, draft_dir = out / "target", out / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)
    log(f"device {device}, torch {torch.__version__}, transformers {transformers.__version__}")

    train_texts, heldout_texts = build_corpus(r.max_train_bytes, r.max_heldout_bytes)
    train_bytes = sum(len(t.encode()) for t in train_texts)
    heldout_bytes = sum(len(t.encode()) for t in heldout_texts)
    log(
        f"corpus: {len(train_texts)} train docs ({train_bytes / 1e6:.1f} MB), "
        f"{len(heldout_texts)} held-out docs ({heldout_bytes / 1e6:.2f} MB)"
    )
    t = time.time()
    tok = train_tokenizer(train_texts, r.vocab)
    tok_seconds = time.time() - t
    eos_id = tok.token_to_id(EOS_TOKEN)
    save_tokenizer(tok, target_dir, 4 * r.seq_len)
    train_ids = encode_stream(tok, train_texts)
    heldout_ids = encode_stream(tok, heldout_texts)
    log(
        f"tokenizer: vocab {tok.get_vocab_size()} in {tok_seconds:.1f}s; "
        f"{len(train_ids):,} train tokens, {len(heldout_ids):,} held-out tokens"
    )
    train_data = torch.tensor(train_ids, dtype=torch.long, device=device)
    heldout_data = torch.tensor(heldout_ids, dtype=torch.long, device=device)
    heldout_windows = fixed_windows(heldout_data, r.eval_windows, r.seq_len)
    train_windows = fixed_windows(train_data, r.eval_windows, r.seq_len)
    eval_batch = r.batch

    def ce(model: Any, w: Any) -> Any:
        logits = trainer.logits(model, w[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())

    @torch.no_grad()
    def eval_ce(model: Any, windows: Any) -> float:
        model.eval()
        return mean_over_windows(windows, eval_batch, lambda w: ce(model, w))

    budget = args.time_budget_s
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(make_config(r.target, r.vocab, eos_id, 4 * r.seq_len)).to(device)
    log(f"target: {r.target}, {count_params(target):,} parameters")
    target_run = trainer.train(
        "target",
        target,
        train_data,
        args.steps_target or r.steps_target,
        r.lr_target,
        None if budget is None else TARGET_SHARE * budget,
        ce,
        lambda: eval_ce(target, heldout_windows),
        seed_offset=1,
    )
    target_heldout = eval_ce(target, heldout_windows)
    target_train_eval = eval_ce(target, train_windows)
    log(f"target done: train loss {target_run.final_train_loss}, held-out {target_heldout:.4f}")
    save_model(target, target_dir, int(args.max_shard_mb * 2**20))
    for p in target.parameters():
        p.requires_grad_(False)

    def distil(draft: Any, w: Any) -> Any:
        x = w[:, :-1]
        with torch.no_grad():
            teacher = F.log_softmax(trainer.logits(target, x), dim=-1).flatten(0, 1)
        student = F.log_softmax(trainer.logits(draft, x), dim=-1).flatten(0, 1)
        return F.kl_div(student, teacher, log_target=True, reduction="batchmean")

    @torch.no_grad()
    def eval_kl(draft: Any, windows: Any) -> float:
        draft.eval()
        return mean_over_windows(windows, eval_batch, lambda w: distil(draft, w))

    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(make_config(r.draft, r.vocab, eos_id, 4 * r.seq_len)).to(device)
    log(f"draft: {r.draft}, {count_params(draft):,} parameters")
    draft_run = trainer.train(
        "draft",
        draft,
        train_data,
        args.steps_draft or r.steps_draft,
        r.lr_draft,
        None if budget is None else budget - target_run.seconds,
        distil,
        lambda: eval_kl(draft, heldout_windows),
        seed_offset=2,
    )
    mtp = None
    if args.mtp:
        mtp = train_mtp(
            trainer, target, train_data, heldout_data, args.steps_mtp, args.mtp_time_budget_s, out
        )
    draft_heldout = eval_ce(draft, heldout_windows)
    draft_heldout_kl = eval_kl(draft, heldout_windows)
    log(f"draft done: train KL {draft_run.final_train_loss}, held-out KL {draft_heldout_kl:.4f}")

    # Agreement is measured on the bfloat16 weights that ship.
    target.to(torch.bfloat16)
    draft.to(torch.bfloat16)

    @torch.no_grad()
    def agreement(seq: Any, first: int) -> tuple[float, int]:
        a = trainer.logits(target, seq[:, :-1])[:, first:].argmax(-1)
        b = trainer.logits(draft, seq[:, :-1])[:, first:].argmax(-1)
        return (a == b).float().mean().item(), a.numel()

    text_agree, text_n = agreement(heldout_windows, 0)
    prompts = fixed_windows(heldout_data, r.prompts, r.prompt_len - 1)
    with torch.no_grad():
        continued = greedy_continue(trainer, target, prompts, r.new_tokens)
    greedy_agree, greedy_n = agreement(continued, r.prompt_len - 1)
    log(
        f"draft/target argmax agreement: {text_agree:.3f} on held-out text ({text_n} positions), "
        f"{greedy_agree:.3f} on the target's greedy continuations ({greedy_n} positions)"
    )
    log(f"sample: {tok.decode(continued[0].tolist())!r}")

    save_model(draft, draft_dir, int(args.max_shard_mb * 2**20))
    sizes = {
        "target_model_bytes": weights_bytes(target_dir),
        "draft_model_bytes": weights_bytes(draft_dir),
        "target_folder_bytes": folder_bytes(target_dir),
        "draft_folder_bytes": folder_bytes(draft_dir),
    }
    sizes["models_total_bytes"] = sizes["target_model_bytes"] + sizes["draft_model_bytes"]
    sizes["folders_total_bytes"] = sizes["target_folder_bytes"] + sizes["draft_folder_bytes"]

    report = {
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "quick": args.quick,
        "seed": args.seed,
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "corpus": {
            "train_docs": len(train_texts),
            "heldout_docs": len(heldout_texts),
            "train_bytes": train_bytes,
            "heldout_bytes": heldout_bytes,
            "train_tokens": len(train_ids),
            "heldout_tokens": len(heldout_ids),
            "heldout_rule": f"md5(name) % {HELDOUT_MODULUS} == 0",
        },
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "eos": EOS_TOKEN, "eos_id": eos_id},
        "recipe": asdict(r),
        "target": {
            **asdict(target_run),
            "train_loss_fixed_windows": round(target_train_eval, 4),
            "heldout_loss": round(target_heldout, 4),
        },
        "draft": {
            **asdict(draft_run),
            "final_train_loss_is": "KL(target || draft), nats per token",
            "heldout_kl": round(draft_heldout_kl, 4),
            "heldout_loss": round(draft_heldout, 4),
        },
        **({"mtp": mtp} if mtp is not None else {}),
        "agreement": {
            "heldout_text": round(text_agree, 4),
            "heldout_text_positions": text_n,
            "target_greedy": round(greedy_agree, 4),
            "target_greedy_positions": greedy_n,
        },
        "sizes": sizes,
        "wall_seconds": round(time.time() - start, 1),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)
    return report


if __name__ == "__main__":
    main()
