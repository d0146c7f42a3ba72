"""Convert the trained demo pair to MLX, measure it on this machine and document it.

Takes the folder written by ``scripts/train_demo_models.py`` (``target/`` with the tokenizer
files, ``draft/``, ``train_report.json``) and:

1. converts both with ``mlx_lm.convert`` from the local folders (offline, bfloat16, no
   quantization) into ``<dst>/target`` and ``<dst>/draft``, the draft getting the target's
   tokenizer files (and sharded weights their index back);
2. checks that everything shipped weighs at most 24 MB together;
3. loads both with ``mlx_lm.load`` and generates a few greedy tokens with each;
4. measures the forward cost of 1 to 5 and 9 tokens (64 tokens in the cache) of each model,
   median of repeats, target and draft interleaved so that they share the machine's load;
5. measures greedy agreement on held-out prompts: the target continues each prompt greedily
   and the draft's argmax is compared with the target's token at each generated position
   (under greedy acceptance these are exactly the draft proposals that would be accepted);
   from those matches it counts the tokens per round speculation would give for 1 to 4 draft
   tokens, and the speed-up these and the measured costs predict;
6. writes ``<dst>/README.md``, the pair's model card, from the training report and the facts
   of steps 2 and 5; the forward costs are printed and checked, not written, since they belong
   to this machine rather than to the weights.

Example::

    python scripts/convert_demo_models.py --src demo-run --dst mlx_spec/demo --force
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from demo_corpus import build_corpus

MAX_TOTAL_BYTES = 24_000_000
MIN_COST_RATIO = 5.0
MIN_AGREEMENT = 0.5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
COST_LENGTHS = (1, 2, 3, 4, 5, 9)
MTP_SOURCE = "mtp-head.safetensors"  # the training run's head, Qwen-layout names
MTP_BITS = 8  # the most that fits MAX_MTP_BYTES
MTP_GROUP_SIZE = 64
MAX_MTP_BYTES = 2_000_000
MTP_DEPTH = 4
_PATH_FLAGS = {"--out", "--target-from"}  # flags whose values are this machine's paths


def stage_hf_folders(src: Path, staging: Path) -> dict[str, Path]:
    """Copy the trained folders, giving the draft the target's tokenizer files.

    Args:
        src (Path): the training output folder.
        staging (Path): an empty scratch folder.

    Returns:
        dict[str, Path]: ``{"target": ..., "draft": ...}`` Hugging Face folders.
    """
    folders = {}
    for name in ("target", "draft"):
        folder = staging / name
        shutil.copytree(src / name, folder, copy_function=shutil.copyfile)
        folder.chmod(0o755)  # the GPU run's files come back read-only
        for f in TOKENIZER_FILES:
            if not (folder / f).exists():
                shutil.copyfile(src / "target" / f, folder / f)
        write_shard_index(folder)
        folders[name] = folder
    return folders


def write_shard_index(folder: Path) -> None:
    """Write ``model.safetensors.index.json`` for sharded weights that lack one.

    The training script drops the index to return fewer files; Hugging Face loaders need it.

    Args:
        folder (Path): a folder with ``model-XXXXX-of-YYYYY.safetensors`` files.
    """
    from safetensors import safe_open

    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if not shards or index.exists():
        return
    weight_map = {}
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as f:
            weight_map.update(dict.fromkeys(f.keys(), shard.name))
    total = sum(s.stat().st_size for s in shards)
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def convert_one(hf_folder: Path, mlx_folder: Path) -> None:
    """``mlx_lm.convert`` one local folder to bfloat16 MLX weights, no quantization.

    The config keeps ``rope_theta`` at the top level too, where mlx-lm's llama reads it
    (transformers 5 writes it under ``rope_parameters`` only).

    Args:
        hf_folder (Path): a Hugging Face folder with the tokenizer files.
        mlx_folder (Path): the destination; must not exist.
    """
    from mlx_lm import convert

    convert(hf_path=str(hf_folder), mlx_path=str(mlx_folder), dtype="bfloat16", quantize=False)
    # Ship the trained tokenizer files as they are (mlx-lm re-saves them with the installed
    # transformers, whose format older versions may not read), and no stub model card.
    for f in TOKENIZER_FILES:
        shutil.copyfile(hf_folder / f, mlx_folder / f)
    (mlx_folder / "README.md").unlink(missing_ok=True)
    config_path = mlx_folder / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")


def folder_bytes(folder: Path) -> int:
    """Total size of the files in ``folder`` (not recursive)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def make_forward_timer(model: Any, vocab: int, context: int = 64) -> Callable[[int], float]:
    """A function timing one forward pass of ``n`` tokens after ``context`` cached tokens.

    Args:
        model (nn.Module): an mlx-lm model.
        vocab (int): vocabulary size (ids are drawn below it).
        context (int): tokens in the cache before each timed pass.

    Returns:
        Callable[[int], float]: ``time_once(n)`` in seconds; the cache is trimmed back after.
    """
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, vocab, (1, context), key=mx.random.key(0)), cache=cache))

    def time_once(n: int) -> float:
        x = mx.random.randint(0, vocab, (1, n), key=mx.random.key(n))
        mx.eval(x)
        t = time.perf_counter()
        mx.eval(model(x, cache=cache))
        elapsed = time.perf_counter() - t
        trim_prompt_cache(cache, n)
        return elapsed

    return time_once


def measure_costs(models: dict[str, Any], vocab: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median forward cost in milliseconds of each model for each of ``COST_LENGTHS``.

    The models are timed in turn inside each repeat, so a change of load hits both alike.

    Args:
        models (dict[str, nn.Module]): models by name.
        vocab (int): vocabulary size.
        repeats (int): timed repeats per length, after 3 untimed ones.

    Returns:
        dict[str, dict[int, float]]: ``costs[name][n]`` in ms.
    """
    timers = {name: make_forward_timer(m, vocab) for name, m in models.items()}
    samples: dict[str, dict[int, list[float]]] = {n: {k: [] for k in COST_LENGTHS} for n in models}
    for i in range(repeats + 3):
        for n in COST_LENGTHS:
            for name, time_once in timers.items():
                t = time_once(n)
                if i >= 3:
                    samples[name][n].append(t)
    return {
        name: {n: round(statistics.median(v) * 1e3, 3) for n, v in by_n.items()}
        for name, by_n in samples.items()
    }


def greedy_continue(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` with a KV cache; returns the new tokens only."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(new_tokens):
        token = mx.argmax(logits[0, -1])
        out.append(token.item())
        logits = model(token.reshape(1, 1), cache=cache)
    return out


def agreement_matches(
    target: Any, draft: Any, prompts: list[list[int]], new_tokens: int
) -> list[list[bool]]:
    """Per generated position, whether the draft's argmax equals the target's greedy token.

    Args:
        target (nn.Module): the target model.
        draft (nn.Module): the draft model.
        prompts (list[list[int]]): token ids of each prompt.
        new_tokens (int): tokens the target generates after each prompt.

    Returns:
        list[list[bool]]: ``new_tokens`` matches for each prompt.
    """
    matches = []
    for prompt in prompts:
        cont = greedy_continue(target, prompt, new_tokens)
        seq = mx.array([prompt + cont[:-1]])
        guesses = mx.argmax(draft(seq)[0, len(prompt) - 1 :], axis=-1).tolist()
        matches.append([g == c for g, c in zip(guesses, cont, strict=True)])
    return matches


def tokens_per_round(matches: list[list[bool]], num_draft: int) -> float:
    """Mean tokens a greedy speculative round yields, replayed from the match sequences.

    A round at position ``i`` accepts the run of matches starting there (at most
    ``num_draft``) and adds the target's own token.

    Args:
        matches (list[list[bool]]): output of :func:`agreement_matches`.
        num_draft (int): draft tokens per round.

    Returns:
        float: tokens per round.
    """
    tokens, rounds = 0, 0
    for m in matches:
        i = 0
        while i < len(m):
            a = 0
            while a < num_draft and i + a < len(m) and m[i + a]:
                a += 1
            step = min(a + 1, len(m) - i)
            tokens += step
            rounds += 1
            i += step
    return tokens / rounds


def convert_mtp_head(src_file: Path, target_folder: Path, bits: int | None) -> Path:
    """Write the trained MTP head into the converted target's folder as ``mtp.safetensors``.

    The head's weights (Qwen-layout names, from ``train_demo_models.py``) are renamed as
    :class:`mlx_spec.mtp.MTPHead` names them, cast to the target's dtype and, with ``bits``,
    quantized (every linear layer, groups of :data:`MTP_GROUP_SIZE`), then written by
    :func:`mlx_spec.mtp_convert.save_head`, so that ``mlx_spec.load`` attaches them.

    Args:
        src_file (Path): ``mtp-head.safetensors`` of a training run.
        target_folder (Path): the converted target (mlx-lm llama folder).
        bits (int, optional): quantization bits; ``None`` keeps the target's dtype.

    Returns:
        Path: the file written.
    """
    import mlx.nn as nn
    from mlx_lm import load

    from mlx_spec.mtp import new_head, own_names
    from mlx_spec.mtp_convert import save_head

    model, _ = load(str(target_folder))
    dtype = model.model.embed_tokens.weight.dtype
    named = own_names(mx.load(str(src_file)), "qwen", model.args.num_hidden_layers)
    head = new_head(model, "qwen")
    head.load_weights([(k, v.astype(dtype)) for k, v in named.items()], strict=True)
    if bits is not None:
        nn.quantize(head, group_size=MTP_GROUP_SIZE, bits=bits)
    return save_head(head, target_folder)


def mtp_matches(
    model: Any, prompts: list[list[int]], new_tokens: int, depth: int
) -> list[list[list[bool]]]:
    """Whether each token the MTP head drafts equals the target's greedy token there.

    The target continues each prompt greedily; then, for each position ``t`` from the prompt's
    last on, the head is shown the target's hidden states up to ``t`` (as the generation loop
    shows them) and drafts ``depth`` tokens, compared with the target's tokens at ``t + 2``,
    ``t + 3``, ... (under greedy acceptance, those equal are the ones a round keeps).

    Args:
        model (nn.Module): the target, loaded by ``mlx_spec.load`` with its head.
        prompts (list[list[int]]): token ids of each prompt.
        new_tokens (int): tokens the target generates after each prompt.
        depth (int): tokens drafted at each position.

    Returns:
        list: per prompt, per position, ``depth`` bools (fewer near the end of the text).
    """
    from mlx_spec import _mlx_lm
    from mlx_spec.drafters import DraftSetup
    from mlx_spec.loop import Text
    from mlx_spec.mtp import MTPDrafter, head_of
    from mlx_spec.rules import make_rule

    split = _mlx_lm.split(model)
    out = []
    for prompt in prompts:
        seq = prompt + greedy_continue(model, prompt, new_tokens)
        hidden = split.backbone(mx.array([seq]))[0]
        text = Text(mx.array(prompt, dtype=mx.uint32), prompt)
        text.extend(seq[len(prompt) :])
        drafter = MTPDrafter(head_of(model))
        drafter.start(text, DraftSetup(rule=make_rule(None), target=split))
        drafter.see(hidden[: len(prompt)], 0, text)
        rows = []
        for t in range(len(prompt) - 1, len(seq) - 2):
            drafted = drafter.propose(text, depth, None).tokens.tolist()
            rows.append([d == s for d, s in zip(drafted, seq[t + 2 :], strict=False)])
            drafter.update(text, 0)
            drafter.see(hidden[t + 1 : t + 2], t + 1, text)
        out.append(rows)
    return out


def mtp_tokens_per_round(matches: list[list[list[bool]]], num_draft: int) -> float:
    """Mean tokens a greedy round drafting ``num_draft`` MTP tokens yields, replayed from
    :func:`mtp_matches`: a round at position ``t`` keeps the leading matches of ``t``'s draft
    and adds the target's own token."""
    tokens, rounds = 0, 0
    for rows in matches:
        t = 0
        while t < len(rows):
            kept = 0
            while kept < min(num_draft, len(rows[t])) and rows[t][kept]:
                kept += 1
            tokens += kept + 1
            rounds += 1
            t += kept + 1
    return tokens / rounds


def agreement_at(matches: list[list[list[bool]]], depth: int) -> list[float]:
    """For draft positions ``1..depth``: how often the drafted token equals the target's, over
    the positions that have one there."""
    rates = []
    for i in range(depth):
        hits = [row[i] for rows in matches for row in rows if len(row) > i]
        rates.append(sum(hits) / len(hits))
    return rates


def heldout_prompts(tokenizer_file: Path, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens spread evenly over the held-out documents.

    Args:
        tokenizer_file (Path): the shared ``tokenizer.json``.
        count (int): number of prompts.
        length (int): tokens per prompt.

    Returns:
        list[list[int]]: token ids.
    """
    from tokenizers import Tokenizer

    _, heldout = build_corpus()
    encodings = Tokenizer.from_file(str(tokenizer_file)).encode_batch(
        heldout, add_special_tokens=False
    )
    stream = [i for e in encodings for i in e.ids]
    stride = (len(stream) - length) // count
    return [stream[i * stride : i * stride + length] for i in range(count)]


def write_readme(dst: Path, facts: dict[str, Any]) -> None:
    """Write ``<dst>/README.md``, the pair's model card (step 6 above)."""
    tr, t, d = (
        facts["train_report"],
        facts["train_report"]["target"],
        facts["train_report"]["draft"],
    )
    rt, rd = tr["recipe"]["target"], tr["recipe"]["draft"]
    mb = 1e6
    budget = " (stopped by the time budget)" if d["stopped_by_budget"] else ""
    spec_rows = "\n".join(
        f"| {k} | {v['tokens_per_round']:.2f} |" for k, v in facts["speculation"].items()
    )
    text = f"""# The demo model pair

A tiny llama target and a distilled draft that share one byte-level BPE tokenizer
(vocabulary {tr["tokenizer"]["vocab_size"]}), trained on text every Python install carries: the
documentation in `pydoc_data.topics` and the standard library's own source. They are here so that
speculative decoding can be shown on any machine with no download; they are not useful models.

| | target | draft |
| --- | --- | --- |
| layers x hidden (MLP) | {rt["layers"]} x {rt["hidden"]} ({rt["intermediate"]}) \
| {rd["layers"]} x {rd["hidden"]} ({rd["intermediate"]}) |
| attention heads / KV heads | {rt["heads"]} / {rt["kv_heads"]} | {rd["heads"]} / {rd["kv_heads"]} |
| parameters (embeddings tied) | {t["params"]:,} | {d["params"]:,} |
| files on disk | {facts["bytes"]["target"] / mb:.2f} MB | {facts["bytes"]["draft"] / mb:.2f} MB |
| training steps (batch {tr["recipe"]["batch"]} x {tr["recipe"]["seq_len"]} tokens) \
| {t["steps"]} | {d["steps"]}{budget} |
| training loss of the last steps | {t["final_train_loss"]:.3f} (cross-entropy) \
| {d["final_train_loss"]:.3f} (KL to the target) |
| weights kept (lowest held-out loss, checked every {tr["recipe"]["eval_every"]} steps) \
| step {t["best_step"]}: training {t["train_loss_fixed_windows"]:.3f}, held-out \
{t["best_heldout"]:.3f} | step {d["best_step"]}: held-out KL {d["best_heldout"]:.3f} |
| held-out cross-entropy (nats/token) | {t["heldout_loss"]:.3f} | {d["heldout_loss"]:.3f} |

Both folders together: {facts["bytes"]["total"] / mb:.2f} MB (limit {MAX_TOTAL_BYTES / mb:.0f} MB),
bfloat16, no quantization (MLX's CPU backend runs 4-bit layers far slower than bfloat16 ones).

Trained with PyTorch and transformers by `scripts/train_demo_models.py` (seed {tr["seed"]}, the
command below; `train_report.json` beside this file records the run and its versions); the
held-out split is every document whose name satisfies {tr["corpus"]["heldout_rule"]}. Converted
with `mlx_lm.convert` by `scripts/convert_demo_models.py`, which also checks that the pair stays
under the size limit, that a draft forward pass costs at most 1/{MIN_COST_RATIO:.0f} of the \
target's, and that the two agree on at least {MIN_AGREEMENT:.0%} of the held-out positions below.

## Agreement

On {facts["prompts"]} held-out prompts of {facts["prompt_len"]} tokens, the target generated
{facts["new_tokens"]} greedy tokens each; the draft's argmax equals the target's token at
{facts["agreement"]:.1%} of those {facts["positions"]} positions (the training script measured
{tr["agreement"]["heldout_text"]:.1%} on held-out text itself, with PyTorch).

Replaying those matches as greedy speculation with N draft tokens a round:

| N | tokens per round |
| --- | --- |
{spec_rows}

Whether a round pays depends on what a target call over N + 1 positions costs on the machine:
`mlx-spec demo` picks N by measuring, and `docs/performance.md` holds the measurements.

## Reproduce

```bash
python3 scripts/train_demo_models.py --out demo-run {" ".join(facts["train_flags"])}
python scripts/convert_demo_models.py --src demo-run --dst mlx_spec/demo --force
```
"""
    (dst / "README.md").write_text(text)


def ship_mtp(src: Path, dst: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Convert the trained MTP head into ``<dst>/target`` and measure it, unquantized and as
    shipped (:data:`MTP_BITS`), on ``prompts``; returns the facts for the report and model card.
    """
    import mlx_spec

    facts: dict[str, Any] = {}
    for label, bits in (("bfloat16", None), (f"{MTP_BITS}-bit", MTP_BITS)):
        file = convert_mtp_head(src / MTP_SOURCE, dst / "target", bits)
        model, _ = mlx_spec.load(str(dst / "target"))
        matches = mtp_matches(model, prompts, new_tokens, MTP_DEPTH)
        facts[label] = {
            "file_bytes": file.stat().st_size,
            "agreement_at_position": [round(a, 4) for a in agreement_at(matches, MTP_DEPTH)],
            "tokens_per_round": {
                str(n): round(mtp_tokens_per_round(matches, n), 3) for n in range(1, MTP_DEPTH + 1)
            },
            "positions": sum(len(rows) for rows in matches),
        }
        print(f"MTP head, {label}: {facts[label]}", flush=True)
    facts["shipped"] = f"{MTP_BITS}-bit"
    facts["group_size"] = MTP_GROUP_SIZE
    return facts


def write_mtp_section(readme: Path, report: dict[str, Any], facts: dict[str, Any]) -> None:
    """Write (or replace) the ``## MTP head`` section of the model card ``readme``."""
    m, shipped = report["mtp"], facts[facts["shipped"]]
    recipe = m["run"]["recipe"] if "run" in m else report["recipe"]["mtp"]
    budget = ", stopped by the time budget" if m["stopped_by_budget"] else ""
    if m["stopped_by_budget"] and m["best_step"] == m["steps"]:
        budget += " while its held-out loss still fell"
    bf16 = facts["bfloat16"]
    rows = "\n".join(
        f"| {n} | {bf16['tokens_per_round'][n]:.2f} | {shipped['tokens_per_round'][n]:.2f} |"
        for n in bf16["tokens_per_round"]
    )
    agree = "\n".join(
        f"| {i + 1} | {a:.1%} | {shipped['agreement_at_position'][i]:.1%} |"
        for i, a in enumerate(facts["bfloat16"]["agreement_at_position"])
    )
    section = f"""## MTP head

`target/mtp.safetensors` is a multi-token prediction head for the target, in the Qwen layout
(`mtp.fc`, the two pre-projection norms, one decoder layer of the target's kind, the final norm;
the target's own embedding and LM head), {shipped["file_bytes"] / 1e6:.2f} MB: its linear layers
are quantized to {MTP_BITS} bits in groups of {MTP_GROUP_SIZE}. `mlx_spec.load` attaches it, and
`mlx-spec generate --mtp` drafts with it. It was trained with the target frozen, by distillation
from the target's distribution at the position it predicts, {recipe["depths"]} chained steps at
once ({m["steps"]} steps of {recipe["batch"]} x {recipe["seq_len"]} positions{budget};
`train_report.json` records the run).

On the held-out prompts above, from each position the target generated, the head drafted
{MTP_DEPTH} tokens as the generation loop has it draft; how often the token at each draft position
equals the target's greedy token there, whatever the tokens before it:

| position | bfloat16 | as shipped |
| --- | --- | --- |
{agree}

Replayed as greedy speculation with N MTP tokens a round:

| N | tokens per round, bfloat16 | as shipped |
| --- | --- | --- |
{rows}
"""
    args = m["run"]["command"].split()[1:] if "run" in m else []
    kept = [a for i, a in enumerate(args) if not {a, args[i - 1] if i else ""} & _PATH_FLAGS]
    section += f"""
Trained and shipped, from a target already in `mlx_spec/demo/target`:

```bash
python3 scripts/train_demo_models.py --out demo-mtp --target-from mlx_spec/demo/target \\
  {" ".join(kept)}
python scripts/convert_demo_models.py --src demo-mtp --dst mlx_spec/demo --mtp-only
```
"""
    text = readme.read_text()
    start = text.find("## MTP head")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + (text[end + 1 :] if end >= 0 else "")
    marker = text.find("## Reproduce")
    text = text[:marker] + section + "\n" + text[marker:] if marker >= 0 else text + "\n" + section
    readme.write_text(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, required=True, help="train_demo_models.py output")
    p.add_argument("--dst", type=Path, default=Path("mlx_spec/demo"))
    p.add_argument("--force", action="store_true", help="replace <dst>/target and <dst>/draft")
    p.add_argument("--repeats", type=int, default=30, help="timed forward passes per length")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts for agreement")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--mtp-only",
        action="store_true",
        help="only ship the MTP head of --src (mtp-head.safetensors) into the converted target",
    )
    return p.parse_args(argv)


def main_mtp_only(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """``--mtp-only``: ship and measure the head, write the report and the model card's MTP
    section; returns 1 when the head is over :data:`MAX_MTP_BYTES`."""
    dst: Path = args.dst
    prompts = heldout_prompts(dst / "target" / "tokenizer.json", args.prompts, args.prompt_len)
    facts = ship_mtp(args.src, dst, prompts, args.new_tokens)
    report["mtp"]["shipped"] = facts
    (dst / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_mtp_section(dst / "README.md", report, facts)
    size = facts[facts["shipped"]]["file_bytes"]
    ok = size <= MAX_MTP_BYTES
    print(f"{'ok  ' if ok else 'FAIL'} MTP head {size} <= {MAX_MTP_BYTES}", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run everything; returns the exit status (1 when the pair is over the size limit)."""
    from mlx_lm import generate, load

    args = parse_args(argv)
    report = json.loads((args.src / "train_report.json").read_text())
    dst: Path = args.dst
    if args.mtp_only:
        return main_mtp_only(args, report)
    out = {"target": dst / "target", "draft": dst / "draft"}
    for folder in out.values():
        if folder.exists():
            if not args.force:
                raise SystemExit(f"{folder} exists; pass --force to replace it")
            shutil.rmtree(folder)
    dst.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        for name, hf_folder in stage_hf_folders(args.src, Path(staging)).items():
            convert_one(hf_folder, out[name])

    sizes = {name: folder_bytes(folder) for name, folder in out.items()}
    sizes["total"] = sizes["target"] + sizes["draft"]
    print(f"sizes: {sizes} (limit {MAX_TOTAL_BYTES})", flush=True)

    target, tokenizer = load(str(out["target"]))
    draft, draft_tokenizer = load(str(out["draft"]))
    if tokenizer.vocab_size != draft_tokenizer.vocab_size:
        raise SystemExit("target and draft tokenizers differ")
    for name, model in (("target", target), ("draft", draft)):
        text = generate(model, tokenizer, prompt="def __init__(self", max_tokens=24)
        print(f"{name} generates: {text!r}", flush=True)

    vocab = target.args.vocab_size
    costs = measure_costs({"target": target, "draft": draft}, vocab, args.repeats)
    for n in COST_LENGTHS:
        ratio = costs["target"][n] / costs["draft"][n]
        print(
            f"{n} tokens: target {costs['target'][n]:.2f} ms, draft {costs['draft'][n]:.2f} ms"
            f" (x{ratio:.1f})",
            flush=True,
        )

    prompts = heldout_prompts(out["target"] / "tokenizer.json", args.prompts, args.prompt_len)
    matches = agreement_matches(target, draft, prompts, args.new_tokens)
    positions = sum(len(m) for m in matches)
    agreement = sum(sum(m) for m in matches) / positions
    print(f"greedy agreement: {agreement:.3f} over {positions} positions", flush=True)
    speculation = {}
    for k in range(1, 5):
        per_round = tokens_per_round(matches, k)
        round_ms = k * costs["draft"][1] + costs["target"][k + 1]
        speculation[k] = {
            "tokens_per_round": round(per_round, 3),
            "predicted_speedup": round(per_round * costs["target"][1] / round_ms, 3),
        }
        print(f"N={k}: {speculation[k]}", flush=True)

    train_flags = [a for a in report["command"].split()[1:] if not a.startswith(("$", "/"))]
    if "--out" in train_flags:
        train_flags.remove("--out")
    facts = {
        "train_report": report,
        "bytes": sizes,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "positions": positions,
        "agreement": agreement,
        "speculation": speculation,
        "train_flags": train_flags,
    }
    write_readme(dst, facts)
    if (args.src / MTP_SOURCE).is_file():
        report["mtp"]["shipped"] = ship_mtp(args.src, dst, prompts, args.new_tokens)
        write_mtp_section(dst / "README.md", report, report["mtp"]["shipped"])
    ratio = costs["target"][1] / costs["draft"][1]
    checks = {
        f"size {sizes['total']} <= {MAX_TOTAL_BYTES}": sizes["total"] <= MAX_TOTAL_BYTES,
        f"cost ratio {ratio:.1f} >= {MIN_COST_RATIO}": ratio >= MIN_COST_RATIO,
        f"agreement {agreement:.3f} >= {MIN_AGREEMENT}": agreement >= MIN_AGREEMENT,
    }
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    return 0 if sizes["total"] <= MAX_TOTAL_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
