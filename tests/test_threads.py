"""mlx-spec in worker threads, as ``mlx_lm.server`` runs it: the process still exits cleanly.

MLX 0.32 keeps a compile cache per thread. One that still holds entries when its thread ends is
freed by the thread's C++ exit handlers, which take the GIL; if the main thread is finalizing the
interpreter by then, the process aborts with "terminate called without an active exception"
(docs/design.md, "Working around MLX 0.32"). Whether it does is a race, so each case runs in a fresh
interpreter and checks the exit status and stderr.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx_spec

PACKAGE_ROOT = Path(mlx_spec.__file__).resolve().parents[1]
DEMO = PACKAGE_ROOT / "mlx_spec" / "demo"
ABORT = "terminate called"


def run_script(source: str) -> subprocess.CompletedProcess:
    """``python -c source`` beside the mlx_spec under test (``-c`` puts the cwd on the path)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE_ROOT,
    )


def test_acceptance_ops_in_a_worker_thread_let_the_process_exit():
    # With one compiled graph shared by all threads, this script aborted in every run: the
    # worker's cache held the graphs' entries until the thread's C++ exit handlers. Each thread
    # now frees its own compiled graphs with its Python state. Three runs, as the exit races.
    source = """
        import threading
        import mlx.core as mx
        from mlx_spec import accept_greedy, accept_sampled, read

        def verify():
            logits = mx.array([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
            draft = mx.array([1], dtype=mx.uint32)
            print(read(accept_greedy(logits, draft)))
            probs = mx.softmax(logits, axis=-1)
            print(read(accept_sampled(probs, draft, probs[:1], None, mx.random.key(0))))

        worker = threading.Thread(target=verify)
        worker.start()
        worker.join()
    """
    for _ in range(3):
        run = run_script(source)
        assert run.returncode == 0, run.stderr
        assert ABORT not in run.stderr
        # The draft is the argmax of row 0, and with q == p every draft token is kept.
        assert run.stdout.splitlines() == ["(1, 0, False)", "(1, 0, False)"]


def test_loop_in_a_worker_thread_exits_cleanly_after_clear_streams():
    # mlx-lm's llama calls a compiled activation (swiglu), whose entries stay in the thread's
    # cache whatever mlx-spec does: without the last line this script aborted in every run.
    # mx.clear_streams() at the end of the thread, MLX's remedy, frees them (docs/design.md).
    source = f"""
        import threading
        import mlx.core as mx
        from mlx_lm import load
        from mlx_spec import stream_generate
        from mlx_spec.sampling import make_sampler

        def generate():
            target, tokenizer = load({str(DEMO / "target")!r})
            draft, _ = load({str(DEMO / "draft")!r})
            for temp in (0.0, 0.8):
                for response in stream_generate(
                    target, tokenizer, "def f(x):", max_tokens=8, draft_model=draft,
                    sampler=make_sampler(temp=temp), key=mx.random.key(0),
                ):
                    pass
                print(response.finish_reason, response.stats.rounds > 0)
            mx.clear_streams()

        worker = threading.Thread(target=generate)
        worker.start()
        worker.join()
    """
    run = run_script(source)
    assert run.returncode == 0, run.stderr
    assert ABORT not in run.stderr
    assert run.stdout.split() == ["length", "True"] * 2
