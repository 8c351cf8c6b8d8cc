"""torchtitan's own trainer checkpointing through ckptstore, end to end (opt-in).

Skipped unless torchtitan is installed (``pip install -e '.[torchtitan]'`` in the clone; on a CPU-only
torch also ``triton``, which torchtitan imports: docs/TESTING.md, "torchtitan"). Real ``torchrun``
jobs of ``torchtitan.train`` (through ``tests/titan_cpu.py``, the CPU launcher) training the
``llama3_debugmodel`` (6.2 M parameters) with ``--override.imports
ckptstore.integrations.torchtitan.checkpointing``: 6 steps saving every 2, then a restart that
resumes and trains to 10, against one uninterrupted 10-step run; the per-step losses printed by
torchtitan's metrics must be equal. Data and tokenizer are made here (a BPE tokenizer trained on
the Python standard library's sources, which are also the text), so no download is needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install -e '.[torchtitan]' triton; see docs/TESTING.md, 'torchtitan')",
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OVERRIDE = "ckptstore.integrations.torchtitan.checkpointing"
_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-0-9.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _assets(root: str) -> tuple[str, str]:
    """A ``c4_test``-shaped dataset (``data.json``, one ``{"text": ...}`` per line) and a BPE
    tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) within the debug model's vocabulary
    of 2,048, both from the standard library's sources (deterministic)."""
    data_dir, tok_dir = os.path.join(root, "c4_test"), os.path.join(root, "tokenizer")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return data_dir, tok_dir
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(tok_dir, exist_ok=True)
    texts = []
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in sorted(os.listdir(stdlib))[:400]:
        if name.endswith(".py"):
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
                t = f.read()
            texts += [t[i:i + 4000] for i in range(0, len(t), 4000)]
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": special[0], "eos_token": special[1], "add_bos_token": True, "add_eos_token": True}, f)
    return data_dir, tok_dir


def _train(tmp, dump: str, steps: int, *, nproc: int = 1, checkpoint: list[str] | None = None, timeout: float = 900):
    """One torchrun job of torchtitan.train; returns ({step: loss}, output)."""
    data_dir, tok_dir = _assets(str(tmp.parent / "titan-assets"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        os.path.join(HERE, "titan_cpu.py"),
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf_assets_path", tok_dir, "--dataloader.dataset_path", data_dir,
        # the LR schedule of a 10-step run also when a job stops earlier (its "early stopping" option)
        "--training.steps", str(steps), "--lr_scheduler.total_steps", "10", "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--debug.seed", "42", "--validator.no-enable", "--dump_folder", dump,
    ] + (["--parallelism.spmd-backend", "partial_dtensor"] if nproc > 1 else []) + (checkpoint or [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp))
    out = _ANSI.sub("", p.stdout + p.stderr)
    assert p.returncode == 0, f"torchtitan job failed (exit {p.returncode}):\n{out[-6000:]}"
    return {int(s): float(x) for s, x in _LOSS.findall(out)}, out


def _ckpt(mode: str, *more: str, keep: int = 2) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep-latest-k", str(keep),
            "--checkpoint.async-mode", mode, "--override.imports", OVERRIDE, *more]


def _listed(root: str) -> list[tuple[str, bool]]:
    """``ckptstore list ROOT --json``: (version, supersedes another attempt)."""
    out = subprocess.run([sys.executable, "-m", "ckptstore.cli", "list", root, "--json"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), check=True).stdout
    return [(v["version"], bool(v["supersedes"])) for v in json.loads(out)["versions"]]


_REF: dict[int, dict[int, float]] = {}


@pytest.mark.parametrize("nproc,mode", [(1, "disabled"), (2, "async"), (1, "async_with_pinned_mem")],
                         ids=["1rank-sync", "2ranks-async", "1rank-process"])
def test_debug_model_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path, nproc, mode):
    if nproc not in _REF:
        _REF[nproc], _ = _train(tmp_path, str(tmp_path / "ref"), 10, nproc=nproc)
    ref = _REF[nproc]
    assert sorted(ref) == list(range(1, 11))
    dump = str(tmp_path / "run")
    first, out1 = _train(tmp_path, dump, 6, nproc=nproc, checkpoint=_ckpt(mode))
    assert "ckptstore: checkpoints of this job are versions step-N" in out1
    root = os.path.join(dump, "checkpoint")
    assert [v for v, _ in _listed(root)] == ["step-4", "step-6"]  # keep_latest_k=2, by ckptstore's retention
    second, out2 = _train(tmp_path, dump, 10, nproc=nproc, checkpoint=_ckpt(mode))
    assert "ckptstore: loading step-6" in out2
    assert sorted(second) == [7, 8, 9, 10]
    got = {**first, **second}
    table = "\n".join(f"  step {s:2d}: uninterrupted {ref[s]:.5f}  resumed {got[s]:.5f}" for s in sorted(ref))
    print(f"\n[{nproc} rank(s), async_mode={mode}]\n{table}")
    assert got == ref, table
    assert [v for v, _ in _listed(root)] == ["step-8", "step-10"]


def test_load_step_on_an_abandoned_timeline_supersedes(tmp_path):
    """``--checkpoint.load-step 4`` on a store holding step-6, then training to 6 again: the new step-6
    supersedes the abandoned one (stock DCP overwrites; a plain ckptstore writer would refuse)."""
    dump = str(tmp_path / "run")
    _train(tmp_path, dump, 6, checkpoint=_ckpt("disabled", keep=0))
    root = os.path.join(dump, "checkpoint")
    assert _listed(root) == [("step-2", False), ("step-4", False), ("step-6", False)]
    losses, out = _train(tmp_path, dump, 6, checkpoint=_ckpt("disabled", "--checkpoint.load-step", "4", keep=0))
    assert "ckptstore: loading step-4" in out and sorted(losses) == [5, 6]
    assert _listed(root) == [("step-2", False), ("step-4", False), ("step-6", True)]


def test_readme_command_line_is_the_one_tested():
    """The docs' torchtitan command line (docs/howto/torchtitan.md) uses the override this test runs."""
    with open(os.path.join(REPO, "docs", "howto", "torchtitan.md")) as f:
        readme = f.read()
    assert f"--override.imports {OVERRIDE}" in readme or f"--override.imports '{OVERRIDE}=" in readme


def test_sigterm_saves_the_step_reached_and_says_how_to_resume(tmp_path):
    """``--checkpoint.interval 100`` and SIGTERM to ``torchrun`` after step 3: the workers save the
    step they reached at the next step boundary and exit 143 within the grace period, saying how to
    resume in torchtitan's terms; the next run resumes after that step (before: training went on to
    step 34 and the watchdog ended it with nothing saved)."""
    import signal
    import time

    data_dir, tok_dir = _assets(str(tmp_path.parent / "titan-assets"))
    dump = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(HERE, "titan_cpu.py"), "--module", "llama3", "--config", "llama3_debugmodel",
           "--hf_assets_path", tok_dir, "--dataloader.dataset_path", data_dir, "--training.steps", "200",
           "--lr_scheduler.total_steps", "200", "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--debug.seed", "42", "--validator.no-enable", "--dump_folder", dump,
           "--checkpoint.enable", "--checkpoint.interval", "100", "--override.imports", OVERRIDE]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(tmp_path), start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None:
        steps = [int(s) for s, _ in _LOSS.findall(_ANSI.sub("", log.read_text()))]
        if steps and max(steps) >= 3:
            break
        time.sleep(0.2)
    assert p.poll() is None, log.read_text()[-6000:]
    t_sig = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    p.wait(timeout=60)
    took = time.monotonic() - t_sig
    out = _ANSI.sub("", log.read_text())
    listed = _listed(os.path.join(dump, "checkpoint"))
    assert len(listed) == 1, out[-6000:]
    saved = int(listed[0][0].split("-")[1])
    reached = max(int(s) for s, _ in _LOSS.findall(out))
    print(f"\nSIGTERM after step 3: saved {listed[0][0]}, last step trained {reached}, torchrun gone {took:.1f} s after it")
    assert saved == reached and 3 <= saved < 100, out[-6000:]
    assert "Resume by running the same torchtitan command again" in out and "exiting with status 143" in out, out[-6000:]
    assert took < 30, out[-6000:]
    losses, out2 = _train(tmp_path, dump, saved + 2, checkpoint=["--checkpoint.enable", "--checkpoint.interval", "100",
                                                                "--override.imports", OVERRIDE])
    assert f"ckptstore: loading {listed[0][0]}" in out2 and sorted(losses) == [saved + 1, saved + 2]
